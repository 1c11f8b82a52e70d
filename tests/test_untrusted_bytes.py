"""Stored bytes are untrusted input (issue 31, item 5): a crafted pickle planted where a restart reads it is refused
with an error naming the object, and the command it carries never runs.

Each test plants an object whose unpickling runs ``touch <marker>`` (what anyone who can write to the checkpoint
bucket or to shared memory could plant), re-sealed where the format has a checksum, so that the checksum is not what
stops it, and loads it through the path a restart takes: DCP's ``.metadata`` through the storage reader, a DCP bytes
item (a persist's ``rank_state``) through MoC's load planner, the trainer state of a slot or a persist through its
decoder, and a replay window's tail through the window-file reader.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moc_lightning.memory.encoding import decode_state, encode_state
from moc_lightning.replay.window_file import FOOTER, MAGIC, read_buffer
from moc_lightning.sharding.planner import MoCSavePlanner
from moc_lightning.storage import CorruptCheckpointError, corrupt_from, make_storage
from moc_lightning.storage.integrity import METADATA_NAME, METADATA_SEAL, ListedKeysPlanner
from moc_lightning.storage.sealed import checksum

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

NAME = "step_00000010"


class Planted:
    """Unpickled, it runs a shell command: the payload of a crafted checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    path = tmp_path / "code_ran"
    yield path
    assert not path.exists(), "the planted command ran"


def _state(note: object) -> dict[str, object]:
    return {"w": torch.arange(12.0).reshape(3, 4), "note": note}


@pytest.mark.parametrize("backend", ["filesystem", "tensorstore"])
def test_dcp_metadata_that_would_run_code_is_refused(tmp_path: Path, marker: Path, backend: str) -> None:
    storage = make_storage(backend, str(tmp_path / "ckpt"))
    dcp.save(_state("lr v2"), storage_writer=storage.writer(NAME), planner=MoCSavePlanner(None), no_dist=True)
    metadata = next((tmp_path / "ckpt").rglob(METADATA_NAME))
    body = pickle.dumps(Planted(marker))
    metadata.write_bytes(body + METADATA_SEAL + checksum(body).to_bytes(4, "big"))  # sealed: the CRC matches

    with pytest.raises(CorruptCheckpointError) as refused:
        storage.reader(NAME).read_metadata()
    message = str(refused.value)
    assert NAME in message and METADATA_NAME in message and "posix.system" in message, message


@pytest.mark.parametrize("backend", ["filesystem", "tensorstore"])
def test_a_dcp_bytes_item_that_would_run_code_is_refused(tmp_path: Path, marker: Path, backend: str) -> None:
    """Written by DCP's own ``torch.save`` of the item, so its stored checksum is right; MoC's planner, which every
    MoC load uses (a persist's units, a rank's ``rank_state``), refuses it."""
    storage = make_storage(backend, str(tmp_path / "ckpt"))
    dcp.save(_state(Planted(marker)), storage_writer=storage.writer(NAME), planner=MoCSavePlanner(None), no_dist=True)

    loaded = _state(None)
    with pytest.raises(CheckpointException) as caught:
        dcp.load(loaded, storage_reader=storage.reader(NAME), planner=ListedKeysPlanner(NAME), no_dist=True)
    error = corrupt_from(caught.value)
    assert error is not None, caught.value
    assert "note" in str(error) and "posix.system" in str(error), error
    assert loaded["note"] is None


def test_trainer_state_that_would_run_code_is_refused(marker: Path) -> None:
    """The decoder of a slot's trainer state and of a persist's ``rank_state`` text."""
    with pytest.raises(ValueError, match=r"trainer state.*posix\.system"):
        decode_state(encode_state({"loops": {}, "callbacks": {"Planted": Planted(marker)}}))


def test_the_trainer_state_a_fit_captures_still_decodes() -> None:
    """What MoC captures from a Lightning fit: loops, callbacks' state, optimizer hyper-parameters, LR schedulers and
    this rank's RNG streams (a NumPy state among them)."""
    from lightning.fabric.utilities.seed import _collect_rng_states

    state = {
        "epoch": 0, "global_step": 3, "pytorch-lightning_version": "2.6.0",
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.5), "dirpath": "/x"}},
        "optimizer_states": [{"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1]}]}],
        "lr_schedulers": [{"base_lrs": [0.1], "last_epoch": 3, "_last_lr": [0.1]}],
        "moc_rng": _collect_rng_states(include_cuda=False),
    }  # fmt: skip
    decoded = decode_state(encode_state(state))
    assert decoded["moc_rng"]["numpy"][0] == "MT19937"
    assert (decoded["moc_rng"]["numpy"][1] == state["moc_rng"]["numpy"][1]).all()
    assert torch.equal(decoded["moc_rng"]["torch"], state["moc_rng"]["torch"])
    assert torch.equal(decoded["callbacks"]["ModelCheckpoint{'monitor': None}"]["best_model_score"], torch.tensor(0.5))
    assert decoded["optimizer_states"] == state["optimizer_states"] and decoded["loops"] == state["loops"]


def test_a_window_tail_that_would_run_code_is_refused(marker: Path) -> None:
    tail = io.BytesIO()
    torch.save({"schedule": Planted(marker)}, tail)
    data = tail.getvalue() + FOOTER.pack(0, len(tail.getvalue()), MAGIC)

    with pytest.raises(ValueError, match=r"window.*posix\.system"):
        read_buffer(data)


class UsersOwn:
    """A type of the user's in a callback's state: refused unless the user allows it."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_a_type_the_user_allows_later_decodes_and_is_refused_again_outside() -> None:
    """The restricted unpickler is built once per allow-list: one built before ``add_safe_globals`` must not stand for
    the list after it (nor the other way round)."""
    encoded = encode_state({"loops": {}, "callbacks": {"Mine": UsersOwn(3)}})
    with pytest.raises(ValueError, match=r"trainer state.*UsersOwn.*add_safe_globals"):
        decode_state(encoded)
    with torch.serialization.safe_globals([UsersOwn]):
        assert decode_state(encoded)["callbacks"]["Mine"].value == 3
    with pytest.raises(ValueError, match=r"trainer state.*UsersOwn"):
        decode_state(encoded)
