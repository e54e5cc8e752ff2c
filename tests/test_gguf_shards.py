"""Split-shard sets: writer shards == split(unsplit), merge(shards) == unsplit byte for byte, and every
broken set is refused with a one-line error and no output left behind."""
import shutil
from pathlib import Path

import pytest

from glm5lab.errors import Glm5labError
from glm5lab.gguf import shards as S
from glm5lab.gguf.reader import open_gguf
from glm5lab.gguf.writer import convert_hf_to_gguf, write_gguf
from glm5lab.model.tiny import TINY_GGUF_NAME, build_tiny_model, tiny_config


@pytest.fixture(scope="module")
def written(tiny_paths, tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    return convert_hf_to_gguf(tiny_paths.hf_dir, d / "tiny.gguf", qtype="F16", n_shards=3, progress=False,
                              name=TINY_GGUF_NAME)


def test_merge_is_byte_identical_to_unsplit(tiny_paths, written, tmp_path):
    out = S.merge_shards(written[0], tmp_path / "merged.gguf", progress=False)
    assert out.read_bytes() == tiny_paths.gguf("F16").read_bytes()
    assert "split.count" not in open_gguf(out).first.fields


def test_split_matches_writer_shards_and_round_trips(tiny_paths, written, tmp_path):
    parts = S.split_gguf(tiny_paths.gguf("F16"), 3, tmp_path / "tiny.gguf", progress=False)
    assert [p.name for p in parts] == [p.name for p in written]
    for a, b in zip(parts, written):
        assert a.read_bytes() == b.read_bytes()
    src = tiny_paths.gguf("Q8_0")
    parts = S.split_gguf(src, 5, tmp_path / "q8.gguf", progress=False)
    assert len(parts) == 5
    merged = S.merge_shards(parts, tmp_path / "q8-merged.gguf", progress=False)
    assert merged.read_bytes() == src.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_missing_shard(written, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    for p in written[:2]:
        shutil.copy(p, d / p.name)
    with pytest.raises(Glm5labError, match=r"tiny-00003-of-00003\.gguf: missing shard"):
        S.merge_shards(d / written[0].name, d / "out.gguf", progress=False)
    with pytest.raises(Glm5labError, match="incomplete"):
        S.validate_shard_set(written[:2])  # all three on disk, only two given
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in written[:2])


def test_duplicate_shard(written, tmp_path):
    with pytest.raises(Glm5labError, match="duplicate shard"):
        S.validate_shard_set([written[0], written[1], written[1]])
    d = tmp_path / "dup"
    d.mkdir()
    shutil.copy(written[0], d / written[0].name)
    shutil.copy(written[1], d / written[1].name)
    shutil.copy(written[1], d / written[2].name)  # shard 2 saved under shard 3's name
    with pytest.raises(Glm5labError, match=r"00003-of-00003\.gguf: duplicate shard \(split\.no 1"):
        S.merge_shards(d / written[0].name, d / "out.gguf", progress=False)
    assert not (d / "out.gguf").exists()


def test_shard_from_another_model(tiny_paths, written, tmp_path):
    other_cfg = tiny_config(hidden_size=128, intermediate_size=256)
    model = build_tiny_model(seed=3, config=other_cfg)
    loaders = {k: (lambda v=v: v.detach().numpy()) for k, v in model.state_dict().items()}
    other = write_gguf(loaders, other_cfg, tiny_paths.hf_dir, tmp_path / "o" / "tiny.gguf", qtype="F16",
                       n_shards=3, progress=False)
    d = tmp_path / "mix"
    d.mkdir()
    shutil.copy(written[0], d / written[0].name)
    shutil.copy(other[1], d / written[1].name)
    shutil.copy(written[2], d / written[2].name)
    with pytest.raises(Glm5labError, match=r"00002-of-00003\.gguf: tensor .*shard from another model"):
        S.merge_shards(d / written[0].name, d / "out.gguf", progress=False)
    # a shard of a different split of the same model
    four = convert_hf_to_gguf(tiny_paths.hf_dir, tmp_path / "f" / "tiny.gguf", "F16", n_shards=4, progress=False)
    shutil.copy(four[1], d / written[1].name)
    with pytest.raises(Glm5labError, match="shard from another model or split"):
        S.validate_shard_set([d / p.name for p in written])
    assert not (d / "out.gguf").exists()


def test_failed_merge_leaves_nothing(written, tmp_path, monkeypatch):
    def boom(fout, *a, **k):
        fout.write(b"GGUF partial")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(S, "_write_gguf_stream", boom)
    with pytest.raises(OSError):
        S.merge_shards(written[0], tmp_path / "out.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_shards_in_any_order(tiny_paths, written, tmp_path):
    """The shards as a shell glob or a person lists them: shard 1 (split.no 0, the metadata) need not come first."""
    shuffled = [written[1], written[0], written[2]]
    assert [p.name for p in S.validate_shard_set(shuffled).paths] == [p.name for p in written]
    out = S.merge_shards(shuffled, tmp_path / "merged.gguf", progress=False)
    assert out.read_bytes() == tiny_paths.gguf("F16").read_bytes()


def test_merge_refuses_to_overwrite_a_shard_of_its_own_set(written, tmp_path):
    d = tmp_path / "own"
    d.mkdir()
    parts = [Path(shutil.copy(p, d / p.name)) for p in written]
    before = [p.read_bytes() for p in parts]
    for target in (parts[1], parts[0]):
        with pytest.raises(Glm5labError, match=f"{target.name}: is shard {parts.index(target) + 1} of the set"):
            S.merge_shards(parts[0], target, progress=False)
    assert [p.read_bytes() for p in parts] == before
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in parts)


def test_outputs_are_readable_by_others_and_split_into_a_folder(tiny_paths, written, tmp_path):
    """mkstemp's 0600 must not reach the renamed output: a vLLM server under another account reads it."""
    import os

    mask = os.umask(0o022)
    try:
        merged = S.merge_shards(written, tmp_path / "merged.gguf", progress=False)
        folder = tmp_path / "parts"
        folder.mkdir()
        parts = S.split_gguf(tiny_paths.gguf("F16"), 2, folder, progress=False)
    finally:
        os.umask(mask)
    assert [p.parent for p in parts] == [folder, folder]
    assert parts[0].name == tiny_paths.gguf("F16").stem + "-00001-of-00002.gguf"
    for p in [merged, *parts]:
        assert p.stat().st_mode & 0o777 == 0o644, p
    with pytest.raises(Glm5labError, match="is a folder; give the output file's name"):
        S.merge_shards(written, folder, progress=False)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in parts)


def test_split_out_ending_in_a_slash_is_a_new_folder(tiny_paths, tmp_path, capsys):
    """`--out DIR/` for a folder that does not exist yet: the shards go in it (it was read as a name prefix)."""
    from glm5lab.cli import main

    src = tiny_paths.gguf("F16")
    assert main(["gguf", "split", str(src), "2", "--out", f"{tmp_path / 'new'}/"]) == 0
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [f"{src.stem}-0000{i}-of-00002.gguf" for i in (1, 2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]
