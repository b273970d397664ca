"""The neuron's thread that serves this peer's state to peers catching up (hivemind's protocol)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def _serve_state_requests(serializer, pipe, get_current_state_ref) -> None:
    """The neuron's thread that answers the averager's requests for this peer's state (a peer
    catching up downloads it): hivemind's protocol, but each request is answered in a call of
    its own, so nothing it served (a host copy of the model, the request's pipe) outlives it."""
    while True:
        try:
            trigger, future = pipe.recv()
        except BaseException as exc:  # the pipe closed: the averager has shut down
            logger.debug("swarm: state server finished: %r", exc)
            return
        if trigger == "_SHUTDOWN":
            return
        served = _answer_state_request(serializer, future, get_current_state_ref)
        del future
        if not served:
            return


def _answer_state_request(serializer, future, get_current_state_ref) -> bool:
    """Set ``future`` to (metadata bytes, CPU tensors, tensor infos); False once the averager is gone."""
    get_current_state = get_current_state_ref()
    if get_current_state is None:
        return False
    try:
        state = tuple(get_current_state())
        del get_current_state
        if not 0 < len(state) <= 3:
            raise ValueError(f"get_current_state returned {len(state)} items, expected 1 to 3")
        metadata, tensors, infos = state + (None,) * (3 - len(state))
        # tensors go over as CPU tensors, so that the averager process never initialises CUDA
        future.set_result((serializer.dumps(metadata),
                           tuple(t.cpu().detach().requires_grad_(t.requires_grad) for t in tensors), infos))
    except BaseException as exc:
        future.set_exception(exc)
        logger.warning("swarm: could not serve this peer's state: %r", exc)
    return True


def install_state_server() -> None:
    """Make :func:`_serve_state_requests` the thread hivemind's averager starts in the neuron
    (idempotent). hivemind looks the function up when an averager is created."""
    import hivemind.averaging.averager as hivemind_averager

    hivemind_averager._background_thread_fetch_current_state = _serve_state_requests
