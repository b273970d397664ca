"""Offloading (dtrain/training/offload.py): state moved to disk while idle comes back bit for bit,
as the same tensor objects, whatever else holds or exported them; a trainer brings it back
before any method that needs it, so a step, a checkpoint and a state export see the real values."""

from __future__ import annotations

import os

import torch

from dtrain.training.offload import Offload
from dtrain.training.trainer import Trainer, TrainerConfig


def test_offloaded_tensors_free_their_memory_and_come_back_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.randn(512, 300))
    other = torch.randn(1000)
    view = other[10:20]  # two tensors of one storage: written once, both restored onto it
    _ = big.detach().numpy()  # an exported storage cannot be resized: offload must not need to
    before = [big.detach().clone(), other.clone()]
    off = Offload(str(tmp_path / "off"), [big, other, view, big])
    assert off.nbytes == 4 * (512 * 300 + 1000)
    assert big.numel() == 0 and other.numel() == 0 and view.numel() == 0
    assert os.listdir(tmp_path / "off") == []  # an unlinked file
    off.restore()
    assert torch.equal(big.detach(), before[0]) and torch.equal(other, before[1])
    assert big.shape == (512, 300) and big.requires_grad and isinstance(big, torch.nn.Parameter)
    view.fill_(7.0)
    assert float(other[15]) == 7.0  # the view is of the restored storage again


def _trainer(optimizer: str) -> Trainer:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    cfg = TrainerConfig(micro_batch_size=4, local_batch_size=4, optimizer=optimizer, lr=0.1, momentum=0.7,
                        weight_decay=0.0, warmup_steps=0, total_steps=10, min_lr_ratio=1.0, grad_clip=None,
                        precision="fp32", device="cpu")
    return Trainer(model, cfg)


def _step(trainer: Trainer, seed: int) -> None:
    torch.manual_seed(seed)
    trainer.set_gradients([torch.randn_like(p) for p in trainer.params], num_samples=1)
    trainer.step()


def test_a_trainer_brings_its_offloaded_state_back_before_it_is_used(tmp_path):
    # The same steps with and without offloading in between give the same bits.
    plain, offloaded = _trainer("nesterov"), _trainer("nesterov")
    for seed in range(3):
        _step(plain, seed)
        _step(offloaded, seed)  # brings back what was offloaded after the last one
        moved = offloaded.offload(str(tmp_path), parameters=False)
        assert moved == 4 * sum(p.numel() for p in offloaded.params)  # the momentum buffers
        assert offloaded.offload(str(tmp_path), parameters=False) == 0  # already out
    _step(plain, 9)
    _step(offloaded, 9)
    assert all(torch.equal(a, b) for a, b in zip(plain.params, offloaded.params))
    # a checkpoint's state taken while the momentum is out holds the real momentum
    offloaded.offload(str(tmp_path), parameters=False)
    state = offloaded.state_dict()
    assert all(torch.equal(a["momentum_buffer"], b["momentum_buffer"])
               for a, b in zip(state["optimizer"]["state"].values(), plain.state_dict()["optimizer"]["state"].values()))


def test_parameters_and_adamw_moments_offloaded_together(tmp_path):
    from dtrain.neurons.sync import export_state

    a, b = _trainer("adamw"), _trainer("adamw")
    _step(a, 5)
    _step(b, 5)
    b.offload(str(tmp_path), parameters=True)
    assert all(p.numel() == 0 for p in b.params)
    _, exported = export_state(b, epoch=3)  # a peer catching up is served the real state
    _, reference = export_state(a, epoch=3)
    assert all(torch.equal(x, y) for x, y in zip(exported, reference))


def test_a_full_disk_keeps_the_state_in_memory(tmp_path):
    trainer = _trainer("nesterov")
    _step(trainer, 1)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    before = [p.detach().clone() for p in trainer.params]
    assert trainer.offload(str(blocker / "offload"), parameters=True) == 0  # cannot write there
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.params))
    _step(trainer, 2)  # and it trains on
