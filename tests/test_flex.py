"""Paddle's flex checkpoints read as data (`paddle_pp/interop/flex.py`): pieces two ranks saved through
Paddle's own `save_state_dict` in the forms PaddleFormers' layouts write (rows split as tensor
parallelism splits them, uneven columns, sharding stage1 v2's flat ranges, a replicated vector stored
once, bfloat16) assemble into the whole tensors bit for bit; a missing piece file or a metadata
pickle that names anything but Paddle's metadata records is refused by name."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from paddle_pp.interop.flex import FlexCheckpointError, FlexFolder, flex_parts, verify_flex
from paddle_pp.interop.pickled import UnsafePickleError

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def saved(run_workers_module, tmp_path_factory):
    base = tmp_path_factory.mktemp("flex")
    run_workers_module("flex_save_worker.py", 2, [str(base / "model_state")], timeout=200, tag="flex_save")
    return base


def test_pieces_of_two_ranks_assemble_into_the_whole_tensors(saved):
    expected = np.load(saved / "expected.npz")
    folder = flex_parts(saved)["model_state"]
    assert folder.names() == sorted(expected.files)
    flat = folder.metadata.state_dict_metadata["model.layers.0.mlp.up_proj.weight.moment1_0"]
    assert [piece.flattened_range for piece in flat] == [(0, 7), (7, 24)], "stage1 v2's flat ranges"
    for name in expected.files:
        whole = folder.tensor(name)
        assert whole.shape == expected[name].shape and np.array_equal(whole.astype(np.float32), expected[name]), name
    assert folder.dtype("lm_head.weight") == np.dtype("bfloat16")
    assert verify_flex(saved) == []


def test_a_missing_piece_file_or_a_foreign_global_is_refused(saved, tmp_path):
    import shutil

    broken = tmp_path / "model_state"
    shutil.copytree(saved / "model_state", broken)
    (broken / "1_0.distcp").unlink()
    problems = verify_flex(tmp_path)
    assert problems and all("1_0.distcp is missing" in problem for problem in problems)

    class Payload:
        def __reduce__(self):
            return (print, ("pwned",))

    (broken / "0.metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UnsafePickleError, match="builtins.print"):
        FlexFolder(broken)
    with pytest.raises(FlexCheckpointError, match="not a flex checkpoint"):
        flex_parts(tmp_path / "nothing_here")
