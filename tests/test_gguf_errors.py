"""Bad input: each case is one Glm5labError line naming the file and the problem, the CLI exits != 0
without a traceback, and no output file (or temp file) is left behind."""
import shutil

import gguf
import numpy as np
import pytest

from glm5lab.cli import main
from glm5lab.errors import Glm5labError
from glm5lab.gguf.inspect import inspect_gguf
from glm5lab.gguf.shards import split_gguf
from tests.gguf_edits import edited_gguf


def _bad_files(tiny_paths, d):
    src = tiny_paths.gguf("F16")
    data = src.read_bytes()
    cases = {}
    p = d / "wrong_magic.gguf"
    p.write_bytes(b"GGUX" + data[4:])
    cases["wrong_magic"] = (p, "not a GGUF file")
    p = d / "truncated_header.gguf"
    p.write_bytes(data[:3000])
    cases["truncated_header"] = (p, "truncated or corrupt GGUF header (version 3 declares")
    p = d / "cut_preamble.gguf"
    p.write_bytes(data[:20])
    cases["cut_preamble"] = (p, "the file has 20 bytes, a GGUF preamble alone needs 24")
    p = d / "truncated_data.gguf"
    p.write_bytes(data[: len(data) - 1000])
    cases["truncated_data"] = (p, "truncated tensor data")
    p = d / "llama.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cases["unknown_arch"] = (p, "architecture 'llama' is not 'glm-dsa'")
    p = d / "empty.gguf"
    p.write_bytes(b"")
    cases["empty"] = (p, "not a GGUF file")
    return cases


CASES = ["wrong_magic", "truncated_header", "cut_preamble", "truncated_data", "unknown_arch", "empty"]


@pytest.fixture(scope="module")
def bad(tiny_paths, tmp_path_factory):
    return _bad_files(tiny_paths, tmp_path_factory.mktemp("bad"))


@pytest.mark.parametrize("case", CASES)
def test_python_api_raises_one_line(bad, case):
    path, msg = bad[case]
    with pytest.raises(Glm5labError) as exc:
        inspect_gguf(path)
    text = str(exc.value)
    assert "\n" not in text and str(path) in text and msg in text


@pytest.mark.parametrize("case", CASES)
def test_cli_exit_code_and_no_partial_output(bad, case, tmp_path, capsys):
    path, msg = bad[case]
    assert main(["gguf", "inspect", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and msg in err[0]
    out = tmp_path / "out"
    out.mkdir()
    assert main(["gguf", "split", str(path), "2", "--out", str(out / "x.gguf")]) == 1
    assert main(["gguf", "merge", str(path), str(out / "m.gguf")]) == 1
    assert list(out.iterdir()) == []
    assert "Traceback" not in capsys.readouterr().err


def test_cli_shard_errors(tiny_paths, tmp_path, capsys):
    parts = split_gguf(tiny_paths.gguf("F16"), 3, tmp_path / "s.gguf", progress=False)
    parts[2].unlink()
    assert main(["gguf", "merge", str(parts[0]), str(tmp_path / "m.gguf")]) == 1
    err = capsys.readouterr().err.strip()
    assert "missing shard" in err and parts[2].name in err and "\n" not in err
    shutil.copy(parts[1], parts[2])
    assert main(["gguf", "merge", str(parts[0]), str(tmp_path / "m.gguf")]) == 1
    assert "duplicate shard" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(Glm5labError, match="open the whole set"):
        from glm5lab.gguf.reader import open_gguf
        shutil.copy(parts[0], tmp_path / "renamed.gguf")
        open_gguf(tmp_path / "renamed.gguf")


def test_cli_tiny_write_inspect(tiny_paths, tmp_path, capsys):
    assert main(["gguf", "write", str(tiny_paths.hf_dir), str(tmp_path / "w.gguf"), "--qtype", "BF16",
                 "--shards", "2"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w-00001-of-00002.gguf", "w-00002-of-00002.gguf"]
    capsys.readouterr()
    assert main(["gguf", "inspect", str(tmp_path / "w-00002-of-00002.gguf"), "--json"]) == 0
    import json

    info = json.loads(capsys.readouterr().out)
    assert info["header"]["shards"] == 2 and info["hyperparams"]["attention.kv_lora_rank"] == 512
    assert main(["gguf", "write", str(tmp_path), str(tmp_path / "x.gguf")]) == 1  # not an HF dir
    assert main(["gguf", "write", str(tiny_paths.hf_dir), str(tmp_path / "x.gguf"), "--qtype", "Q4_K"]) == 1
    assert "unsupported GGUF type" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


def test_bad_hf_checkpoint_leaves_nothing(tiny_paths, tmp_path):
    """A checkpoint missing a tensor fails mid-stream (headers already written): one-line error, no file."""
    from glm5lab.gguf.writer import hf_tensor_loaders, write_gguf
    from glm5lab.model.tiny import tiny_config

    loaders = hf_tensor_loaders(tiny_paths.hf_dir)
    del loaders["model.layers.2.self_attn.kv_b_proj.weight"]
    with pytest.raises(Glm5labError, match="no tensor 'model.layers.2.self_attn.kv_b_proj.weight'"):
        write_gguf(loaders, tiny_config(), tiny_paths.hf_dir, tmp_path / "x.gguf", qtype="Q8_0", n_shards=2,
                   progress=False)
    assert list(tmp_path.iterdir()) == []


def test_more_bad_inputs_are_one_line_errors(tiny_paths, tmp_path, capsys):
    """What a fresh-eyes audit hit as tracebacks: each is now one line naming the file and the problem."""
    from glm5lab.gguf import shards as S
    from glm5lab.gguf.reader import open_reader
    from glm5lab.model.tiny import TINY_GGUF_NAME

    data = tiny_paths.gguf("F16").read_bytes()
    corrupt = bytearray(data)
    corrupt[data.index(TINY_GGUF_NAME.encode())] = 0xFF  # general.name no longer UTF-8
    bad_name = tmp_path / "bad_name.gguf"
    bad_name.write_bytes(bytes(corrupt))
    no_tensors = tmp_path / "no_tensors.gguf"  # the tiny model's metadata, an empty tensor table
    with open(no_tensors, "wb") as f:
        S._write_gguf_stream(f, 3, S._raw_kv_records(open_reader(tiny_paths.gguf("F16"))), [], [], 32, None)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{not json")
    cut = tmp_path / "cut_safetensors"
    cut.mkdir()
    shutil.copy(tiny_paths.hf_dir / "config.json", cut / "config.json")
    (cut / "model.safetensors").write_bytes((tiny_paths.hf_dir / "model.safetensors").read_bytes()[:1000])
    out = tmp_path / "out"
    out.mkdir()
    cases = [
        (["gguf", "inspect", str(bad_name)], f"{bad_name}: metadata general.name is not valid UTF-8"),
        (["gguf", "inspect", str(tmp_path)], f"{tmp_path}: is a folder, not a GGUF file"),
        (["gguf", "split", str(no_tensors), "2"], "holds 0 tensor(s); a split needs at least 2"),
        (["gguf", "estimate", "--qtypes", "Q4_K,FOO"], "unknown GGML type 'FOO'"),
        (["gguf", "write", str(tiny_paths.hf_dir), str(out)], f"{out}: is a folder; give the output file's name"),
        (["gguf", "write", str(config_only), str(out / "x.gguf")], "config.json: transformers cannot read it"),
        (["gguf", "write", str(cut), str(out / "x.gguf")], "model.safetensors: not a readable safetensors file"),
        (["gguf", "tiny", "--root", str(bad_name)], "is a file; the cache root must be a folder"),
    ]
    for argv, message in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and message in err, (argv, err)
    assert list(out.iterdir()) == []
    assert main(["gguf", "inspect", str(no_tensors), "--json", "--tensors"]) == 0  # an empty table, not a KeyError
    import json

    info = json.loads(capsys.readouterr().out)
    assert info["header"]["tensors"] == 0 and info["tensors"] == []


def test_inspect_into_a_closed_pipe_is_quiet(tiny_paths):
    """`glm5lab gguf inspect X | head`: no BrokenPipeError traceback once the reader has gone. `true` closes the
    pipe before Python has even started, so the first write meets it closed (head would race the pipe's buffer)."""
    import subprocess
    import sys

    cmd = f"{sys.executable} -m glm5lab gguf inspect {tiny_paths.gguf('F16')} --tensors | true"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 141  # 128 + SIGPIPE, as a killed writer reports


def test_metadata_and_tensor_table_faults_are_named(tiny_paths, tmp_path, capsys):
    """What a bad-input audit found reported as another problem, or as a traceback: each names its cause now."""
    from glm5lab.gguf.reader import open_gguf, read_gguf_tensors
    from glm5lab.gguf.shards import require_loadable_tensors

    src = tiny_paths.gguf("F16")
    Q = gguf.GGMLQuantizationType
    rank_str = edited_gguf(src, tmp_path / "rank_str.gguf", values={"glm-dsa.attention.kv_lora_rank": "abc"})
    heads0 = edited_gguf(src, tmp_path / "heads0.gguf", values={"glm-dsa.attention.head_count": 0})
    topk0 = edited_gguf(src, tmp_path / "topk0.gguf", values={"glm-dsa.attention.indexer.top_k": 0})
    dup = edited_gguf(src, tmp_path / "dup.gguf", add_copy=("blk.0.attn_norm.weight", "blk.0.attn_norm.weight"))
    type99 = edited_gguf(src, tmp_path / "type99.gguf", types={"token_embd.weight": 99})
    for path, words in [
        (rank_str, "metadata glm-dsa.attention.kv_lora_rank is str 'abc', expected an integer >= 1"),
        (heads0, "metadata glm-dsa.attention.head_count is int 0, expected an integer >= 1"),
        (topk0, "metadata glm-dsa.attention.indexer.top_k is int 0, expected an integer >= 1"),
        (dup, "tensor name blk.0.attn_norm.weight appears twice in the tensor table"),
        (type99, "a tensor has type id 99, which is no GGML type"),
    ]:
        assert main(["gguf", "inspect", str(path)]) == 1, path
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err and str(path) in err, (path, err)

    # tensors the reader cannot dequantize: named with their type, by the reader and before a load starts
    i8 = edited_gguf(src, tmp_path / "i8.gguf", types={"blk.0.attn_q_a.weight": int(Q.I8)})
    with pytest.raises(Glm5labError, match=r"tensor blk.0.attn_q_a.weight is I8, a type gguf .* cannot dequantize"):
        read_gguf_tensors(i8, ["blk.0.attn_q_a.weight"])
    with pytest.raises(Glm5labError, match=r"1 tensor\(s\) of a type glm5lab cannot read, e.g. blk.0.attn_q_a.weight"):
        require_loadable_tensors(open_gguf(i8))
    # vLLM fuses attn_q_a with attn_kv_a_mqa: one quantized and one float cannot load (Q4_0's bytes are fewer, so the
    # table still fits the file)
    mixed = edited_gguf(src, tmp_path / "mixed.gguf", types={"blk.1.attn_q_a.weight": int(Q.Q4_0)})
    with pytest.raises(Glm5labError, match=r"blk.1.attn_q_a.weight is Q4_0 and blk.1.attn_kv_a_mqa.weight is F16"):
        require_loadable_tensors(open_gguf(mixed))
    absent = edited_gguf(src, tmp_path / "absent.gguf", drop_tensor="blk.2.attn_kv_a_mqa.weight")
    with pytest.raises(Glm5labError, match=r"1 tensor\(s\) its metadata implies are absent, e.g. "
                                           r"blk.2.attn_kv_a_mqa.weight"):
        require_loadable_tensors(open_gguf(absent))
    extra = edited_gguf(src, tmp_path / "extra.gguf", add_copy=("blk.9.attn_norm.weight", "blk.0.attn_norm.weight"))
    with pytest.raises(Glm5labError, match=r"tensor blk.9.attn_norm.weight lies past the metadata's "
                                           r"glm-dsa.block_count 3"):
        require_loadable_tensors(open_gguf(extra))
    require_loadable_tensors(open_gguf(src))   # the good file passes


def test_shards_renamed_or_listed_whole_name_the_real_problem(tiny_paths, tmp_path):
    parts = split_gguf(tiny_paths.gguf("F16"), 3, tmp_path / "s.gguf", progress=False)
    renamed = tmp_path / "second.gguf"
    shutil.copy(parts[1], renamed)
    from glm5lab.gguf.reader import open_gguf

    with pytest.raises(Glm5labError, match="is shard 2 of a 3-file split set; open the whole set"):
        open_gguf(renamed)              # it was "architecture None is not 'glm-dsa'": later shards carry none
    parts[1].unlink()
    s = open_gguf([parts[0], renamed, parts[2]])    # a list given whole: each file's split.no, not its name
    assert s.paths == [parts[0], renamed, parts[2]] and len(s.tensor_index) > 0


def test_outputs_that_cannot_be_written_or_would_replace_an_input(tiny_paths, tmp_path, capsys):
    parts = split_gguf(tiny_paths.gguf("F16"), 2, tmp_path / "s.gguf", progress=False)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    hf = tmp_path / "hf"
    shutil.copytree(tiny_paths.hf_dir, hf)
    weights = hf / "model.safetensors"
    before = weights.read_bytes()
    cases = [
        (["gguf", "merge", str(parts[0]), str(a_file / "m.gguf")], f"{a_file}: cannot make the output folder"),
        (["gguf", "split", str(tiny_paths.gguf("F16")), "2", "--out", str(a_file / "x.gguf")],
         f"{a_file}: cannot make the output folder"),
        (["gguf", "write", str(tiny_paths.hf_dir), str(a_file / "w.gguf")], f"{a_file}: cannot make the output folder"),
        (["gguf", "write", str(hf), str(weights)], f"{weights}: is a file of the checkpoint folder {hf} this command "
                                                   f"reads; give another output name"),
        (["gguf", "write", str(hf), str(hf / "config.json")], "config.json: is a file of the checkpoint folder"),
    ]
    for argv, words in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, (argv, err)
    assert weights.read_bytes() == before
    assert main(["gguf", "write", str(hf), str(hf / "model-F16.gguf")]) == 0     # a GGUF beside it is no input
    assert main(["gguf", "write", str(hf), str(hf / "model-F16.gguf")]) == 0     # and may be written again
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_checkpoint_config_error_keeps_its_reason(tiny_paths, tmp_path, capsys):
    """transformers puts the field on its error's first line and the reason on the next: both reach the user."""
    import json

    hf = tmp_path / "hf"
    shutil.copytree(tiny_paths.hf_dir, hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["index_topk"] = "abc"
    (hf / "config.json").write_text(json.dumps(cfg))
    assert main(["gguf", "write", str(hf), str(tmp_path / "x.gguf")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "index_topk" in err and "abc" in err, err
