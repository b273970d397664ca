"""Training core: model presets, tokenizer, data pages, local trainer, gradient
fingerprints and checkpoints.

Import the submodules directly (``dtrain.training.trainer`` and friends); this
package file stays empty of imports so ``import dtrain.training`` is cheap and
never pulls in torch. See docs/training.md.
"""
