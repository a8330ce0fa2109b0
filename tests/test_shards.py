"""The shard reader against safetensors' own reader: whole tensors and TP pieces along every axis."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoint.format import CheckpointError
from checkpoint.piece import FlatRange, Piece
from checkpoint.shards import ShardReader


@pytest.fixture
def shard(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"scalar": np.array(3.5, dtype=np.float32), "vector": rng.standard_normal(12).astype(np.float32),
               "matrix": rng.standard_normal((6, 8)).astype(np.float32),
               "cube": rng.standard_normal((4, 6, 10)).astype(np.float64), "ids": np.arange(24, dtype=np.int64)}
    path = tmp_path / "shard.safetensors"
    save_file(tensors, str(path))
    return path


def test_whole_tensors_equal_safetensors(shard):
    reader, expected = ShardReader(shard), load_file(str(shard))
    assert reader.names == set(expected)
    for name, value in expected.items():
        got = reader.read(name)
        assert got.dtype == value.dtype and got.shape == value.shape and np.array_equal(got, value), name


@pytest.mark.parametrize("name, axis, parts", [("vector", 0, 3), ("matrix", 0, 2), ("matrix", 1, 4),
                                               ("cube", 1, 2), ("cube", 2, 5)])
def test_pieces_along_any_axis_equal_numpy_splits(shard, name, axis, parts):
    reader, full = ShardReader(shard), load_file(str(shard))[name]
    reader.BLOCK_BYTES = 16  # force several blocks of rows, the path large tensors take
    for part, expected in enumerate(np.split(full, parts, axis=axis)):
        assert np.array_equal(reader.read(name, Piece(axis, parts, part)), expected), (name, axis, part)


@pytest.mark.parametrize("checked", [True, False], ids=["scan-checked", "read"])
def test_a_stage3_slice_of_a_tp_piece_is_cut_from_that_piece_flat_and_zero_padded(shard, checked):
    """Stage3 holds a TP piece as one flat slice per sharding rank (the last one padded with zeros):
    each rank's read gives its slice, and the slices put back together give the TP piece."""
    from concurrent.futures import ThreadPoolExecutor

    tp_piece = np.split(load_file(str(shard))["cube"], 2, axis=2)[1]  # 4 x 6 x 5 = 120 elements
    ranks, width = 7, 18  # 7 x 18 = 126: the last slice holds 12 elements and 6 zeros
    slices = []
    for rank in range(ranks):
        piece = Piece(2, 2, 1, FlatRange(rank, ranks, width))
        if checked:
            got = {}
            with ThreadPoolExecutor(max_workers=1) as hasher:
                ShardReader(shard).scan({"cube": piece}, got.__setitem__, hasher, "crc32", {"cube": np.zeros(width)})
            slices.append(got["cube"])
        else:
            slices.append(ShardReader(shard).read("cube", piece))
    assert all(s.shape == (width,) for s in slices)
    whole = np.concatenate(slices)
    assert np.array_equal(whole[:tp_piece.size], tp_piece.reshape(-1)) and not whole[tp_piece.size:].any()


def test_bfloat16_is_widened_exactly(tmp_path):
    values = np.array([1.0, -2.5, 3.140625], dtype=np.float32)  # exactly representable in bfloat16
    bits = (values.view(np.uint32) >> 16).astype("<u2")
    header = json.dumps({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, bits.nbytes]}}).encode()
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bits.tobytes())
    assert np.array_equal(ShardReader(path).read("w"), values)


def test_torn_header_is_a_clear_error(shard):
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        ShardReader(shard)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "pieces-only"])
def test_scan_reads_into_given_arrays_and_sums_every_byte(shard, checked):
    """A load's pass over a file: wanted tensors and TP pieces land in their arrays (any shape of
    their size, in their stored dtype) or else go to `deliver`; a checked pass sums the whole file,
    in either recorded algorithm."""
    import hashlib
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    expected = load_file(str(shard))
    wanted = {"matrix": Piece(1, 4, 2), "cube": Piece(2, 2, 1), "ids": Piece(None, 1, 0), "vector": Piece(0, 3, 1),
              "scalar": Piece(None, 1, 0)}
    into = {"matrix": np.zeros((6, 2), np.float32), "cube": np.zeros(120, np.float64),
            "ids": np.zeros((4, 6), np.int64), "scalar": np.zeros((), np.float64)}  # scalar: not its stored dtype
    delivered = {}
    with ThreadPoolExecutor(max_workers=1) as hasher:
        crc = ShardReader(shard).scan(wanted, delivered.__setitem__, hasher if checked else None, "crc32", into)
        sha = ShardReader(shard).scan({}, delivered.__setitem__, hasher, "sha256")
    assert np.array_equal(into["matrix"], expected["matrix"][:, 4:6])
    assert np.array_equal(into["cube"].reshape(4, 6, 5), expected["cube"][:, :, 5:])
    assert np.array_equal(into["ids"].reshape(-1), expected["ids"]) and into["scalar"] == 0
    assert set(delivered) == {"vector", "scalar"} and np.array_equal(delivered["vector"], expected["vector"][4:8])
    assert delivered["scalar"] == expected["scalar"] and delivered["vector"].flags.c_contiguous
    assert crc == (f"{zlib.crc32(shard.read_bytes()):08x}" if checked else None)
    assert sha == hashlib.sha256(shard.read_bytes()).hexdigest()


def test_load_writes_file_bytes_into_the_tensor_itself():
    import paddle

    from checkpoint.load import _writable_view

    tensor = paddle.zeros([3, 4])
    _writable_view(tensor)[...] = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert np.array_equal(tensor.numpy(), np.arange(12, dtype=np.float32).reshape(3, 4))
    assert _writable_view(paddle.zeros([2]).astype("bfloat16")) is None


@pytest.mark.parametrize("o_direct", ["taken", "refused"])
def test_direct_and_fallback_writes_give_a_sound_file_across_buffer_edges(tmp_path, o_direct, monkeypatch):
    """O_DIRECT through 4 KiB-aligned bounce buffers (shrunk here so tensors straddle them and the
    last block is partial), and the buffered fallback where a file system refuses O_DIRECT at open,
    write the same file."""
    import errno
    import os

    from checkpoint.shards import DirectWriter, TensorSpec, write_shard

    monkeypatch.setattr(DirectWriter, "BUFFER_BYTES", 3 * DirectWriter.ALIGN)
    if o_direct == "refused":
        real_open = os.open

        def refusing_open(path, flags, *args):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "O_DIRECT not supported")
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", refusing_open)
    rng = np.random.default_rng(5)
    tensors = {f"t{i}": rng.standard_normal(size, dtype=np.float32) for i, size in enumerate([1, 3001, 7, 4096, 12345])}
    entry = write_shard(tmp_path / "ours.safetensors", [TensorSpec(n, a.dtype, a.shape) for n, a in tensors.items()],
                        tensors.values())
    probe = DirectWriter(tmp_path / "probe")
    assert probe.direct == (o_direct == "taken")
    probe.close()
    data = (tmp_path / "ours.safetensors").read_bytes()
    assert entry["size"] == len(data) and entry["crc32"] == f"{zlib.crc32(data):08x}"
    loaded = load_file(str(tmp_path / "ours.safetensors"))
    assert all(np.array_equal(loaded[n], a) for n, a in tensors.items())


@pytest.mark.parametrize("pieces_first, mapping", [(True, "taken"), (False, "taken"), (True, "refused"),
                                                   (False, "no fallocate")])
def test_tp_pieces_written_in_place_give_the_whole_file_and_its_exact_crc(tmp_path, pieces_first, mapping,
                                                                          monkeypatch):
    """A shard whose split tensors are written piece by piece by their tp ranks (positioned writes
    along the first axis, a shared mapping for short runs along inner ones, a positioned write per
    long run, or where a file system refuses the mapping or cannot allocate blocks up front), the
    owner streaming the rest with holes, is byte for byte the file the owner writes from whole
    tensors, and the CRC-32 combined from the owner's and the pieces' states is zlib's over the
    finished file, whichever writes first."""
    import mmap

    from checkpoint.crc32_ranges import combine
    from checkpoint.shards import PieceWriter, TensorSpec, shard_layout, write_shard

    if mapping == "refused":
        real_mmap = mmap.mmap

        def refusing_mmap(fd, *args, **kwargs):  # anonymous memory (the O_DIRECT buffers) still maps
            if fd != -1:
                raise OSError("shared writable mappings not supported")
            return real_mmap(fd, *args, **kwargs)

        monkeypatch.setattr(mmap, "mmap", refusing_mmap)
    if mapping == "no fallocate":
        import errno

        monkeypatch.setattr("checkpoint.shards._fallocate", lambda fd, size: errno.EOPNOTSUPP)

    rng = np.random.default_rng(7)
    tensors = {"a_rows": rng.standard_normal((6, 5), dtype=np.float32), "b_whole": rng.standard_normal(7),
               "c_cols": rng.standard_normal((3, 9), dtype=np.float32),
               "d_inner": rng.integers(0, 9, (2, 3, 12)).astype(np.int64),
               "e_tail_cols": rng.standard_normal((4097, 6), dtype=np.float32),
               "f_long_cols": rng.standard_normal((3, 3 * PieceWriter.MAPPED_RUN_BYTES // 4), dtype=np.float32)}
    axes, parts = {"a_rows": 0, "c_cols": 1, "d_inner": 2, "e_tail_cols": 1, "f_long_cols": 1}, 3
    specs = [TensorSpec(name, value.dtype, value.shape) for name, value in tensors.items()]
    reference = write_shard(tmp_path / "whole.safetensors", specs, tensors.values(), {"format": "np"})
    path, (starts, size) = tmp_path / "pieced.safetensors", shard_layout(specs, {"format": "np"})
    states: list[tuple[str, int]] = []

    def write_pieces():
        for part in range(parts):  # each tp rank with its own writer, as in a save
            writer = PieceWriter()
            for name, axis in axes.items():
                piece = np.split(tensors[name], parts, axis=axis)[part]
                states.append((name, writer.write(path, size, starts[name], tensors[name].shape,
                                                  Piece(axis, parts, part), piece)))
            writer.close()

    if pieces_first:
        write_pieces()
    entry = write_shard(path, specs, [tensors["b_whole"]], {"format": "np"}, frozenset(axes))
    if not pieces_first:
        write_pieces()
    crc = combine(int(entry["crc32"], 16), [(state, entry["holes"][name]) for name, state in states])
    assert path.read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    assert f"{crc:08x}" == reference["crc32"] == f"{zlib.crc32(path.read_bytes()):08x}"
    assert entry["size"] == reference["size"]


def test_a_full_disk_fails_a_mapped_piece_write_with_a_clear_error(tmp_path, monkeypatch):
    """Blocks are allocated before a file is mapped, so a full disk is an error naming the file and
    the fix, not a SIGBUS that kills the rank."""
    import errno

    from checkpoint.shards import PieceWriter

    monkeypatch.setattr("checkpoint.shards._fallocate", lambda fd, size: errno.ENOSPC)
    writer, piece = PieceWriter(), np.ones((4, 8), np.float32)
    with pytest.raises(OSError, match="no space left for .*shard.safetensors .*free space or save elsewhere"):
        writer.write(tmp_path / "shard.safetensors", 256, 0, (4, 16), Piece(1, 2, 0), piece)
    writer.close()
