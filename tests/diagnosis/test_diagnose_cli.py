"""flashwatch/diagnosis/cli.py, `flashwatch diagnose`: the three checkpoint kinds end to
end (nanoGPT checkpoints and their growth, a Hugging Face directory, a module function)
and its errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from _helpers import tiny_llama

from examples.gpt import GPT, GPTConfig
from flashwatch.cli import main


def _nanogpt_ckpt(path, model, args):
    torch.save({"model_args": args, "iter_num": 7,
                "model": {"_orig_mod." + k: v for k, v in model.state_dict().items()}}, path)


def test_cli_nanogpt_checkpoints_growth(tmp_path, capsys):
    args = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, bias=True, vocab_size=64,
                dropout=0.0)
    model = GPT(GPTConfig(**args))
    _nanogpt_ckpt(tmp_path / "a.pt", model, args)
    with torch.no_grad():  # layer 1, head 3: W^Q × 3 in the later checkpoint
        model.transformer.h[1].attn.c_attn.weight[24:32] *= 3.0
    _nanogpt_ckpt(tmp_path / "b.pt", model, args)
    np.random.default_rng(0).integers(0, 64, 4000).astype(np.uint16).tofile(tmp_path / "d.bin")
    out = tmp_path / "out"
    code = main(["diagnose", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--data",
                 str(tmp_path / "d.bin"), "--batches", "2", "--out", str(out)])
    assert code == 0
    for name in ("report.md", "diagnose.json", "heads.png", "growth.png"):
        assert (out / name).stat().st_size > 200
    js = json.loads((out / "diagnose.json").read_text())
    assert [c["name"] for c in js["checkpoints"]] == ["a.pt", "b.pt"]
    g = {(r["layer"], r["head"]): r for r in js["growth"]}
    assert g[("transformer.h.1.attn", 3)]["wq_sigma"] == pytest.approx(3.0, rel=1e-6)  # FP32 × 3
    assert g[("transformer.h.1.attn", 2)]["wq_sigma"] == pytest.approx(1.0, rel=1e-12)
    assert all(h["rows"] == 2 * 32 for h in js["checkpoints"][1]["heads"])  # every row
    md = (out / "report.md").read_text()
    assert "grew 3.00× the median head" in md
    assert "| a.pt | " in md and "| b.pt | " in md  # the per-checkpoint table
    cap = capsys.readouterr()
    printed = cap.out.splitlines()
    assert printed[0].startswith("a.pt: ") and printed[1].startswith("b.pt: ")
    # progress into a pipe (not a TTY): whole lines, whole batches
    assert "diagnose b.pt: 2/2 batches done" in cap.err and "\r" not in cap.err


def test_cli_hugging_face_directory(tmp_path, capsys):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "llama")
    torch.save(torch.randint(64, (3, 20)), tmp_path / "rows.pt")
    out = tmp_path / "out"
    code = main(["diagnose", str(tmp_path / "llama"), "--data", str(tmp_path / "rows.pt"),
                 "--batches", "3", "--out", str(out)])
    assert code == 0
    js = json.loads((out / "diagnose.json").read_text())
    (res,) = js["checkpoints"]
    assert len(res["heads"]) == 8 and res["batches"] == 3 and res["dtype"] == "bfloat16"
    assert {h["grad_path"] for h in res["heads"]} == {"autograd"}  # RoPE
    assert all(h["rows"] == 3 * 19 for h in res["heads"])
    md = (out / "report.md").read_text()
    assert "| rank | layer/head | verdict |" in md and "model.layers.1.self_attn" in md


def test_cli_module_function_and_errors(tmp_path, capsys, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "from examples.gpt import GPT, GPTConfig\n"
        "def build():\n    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, "
        "block_size=16))\n")
    monkeypatch.chdir(tmp_path)  # module:function from the current directory, no PYTHONPATH
    (tmp_path / "d.txt").write_text("the quick brown fox jumps over the lazy dog " * 4)
    out = tmp_path / "out"
    assert main(["diagnose", "mymodels:build", "--data", str(tmp_path / "d.txt"),
                 "--batches", "2", "--out", str(out)]) == 0
    assert len(json.loads((out / "diagnose.json").read_text())["checkpoints"][0]["heads"]) == 2
    assert main(["diagnose", str(tmp_path / "nothing-here"), "--data",
                 str(tmp_path / "d.txt")]) == 2
    assert "neither a directory, a file nor module:function" in capsys.readouterr().err
    torch.save({"weights": 1}, tmp_path / "other.pt")
    assert main(["diagnose", str(tmp_path / "other.pt"), "--data",
                 str(tmp_path / "d.txt")]) == 2
    err = capsys.readouterr().err
    assert "found keys ['weights'], no state dict" in err and "accepted: a Hugging Face" in err
    assert err.count("\n") == 1  # one line


def test_the_default_batch_count_can_show_a_persistent_sign():
    """A sign that never changes over n batches has |z| = √n: the default must reach
    diagnose_rank.Z_MIN, or no head can ever be called a paper failure from the CLI."""
    from flashwatch.cli import build_parser
    from flashwatch.diagnosis.rank import Z_MIN

    args = build_parser().parse_args(["diagnose", "ckpt.pt", "--data", "train.bin"])
    assert math.sqrt(args.batches) >= Z_MIN, args.batches


def test_the_demo_saves_checkpoints_diagnose_reads(tmp_path, capsys):
    """`flashwatch diagnose runs/demo-*/ckpt_*.pt --data runs/demo-*/corpus.bin`, as the
    demo's closing lines say: the glob lists the checkpoints oldest first."""
    run = tmp_path / "run"
    assert main(["demo", "--steps", "4", "--every", "4", "--out", str(run)]) == 0
    assert f"flashwatch diagnose {run}/ckpt_*.pt --data {run}/corpus.bin" in \
        capsys.readouterr().out
    ckpts = sorted(str(p) for p in run.glob("ckpt_*.pt"))
    assert [p.rsplit("/", 1)[1] for p in ckpts] == [
        "ckpt_000001.pt", "ckpt_000002.pt", "ckpt_000003.pt", "ckpt_000004.pt"]
    corpus = np.fromfile(run / "corpus.bin", dtype=np.uint16)
    from flashwatch.demo import make_corpus
    assert np.array_equal(corpus, make_corpus(200_000, 0).numpy())  # the demo's seed 0
    out = tmp_path / "out"
    assert main(["diagnose", *ckpts, "--data", str(run / "corpus.bin"), "--batches", "2",
                 "--block", "16", "--out", str(out)]) == 0
    js = json.loads((out / "diagnose.json").read_text())
    assert [c["checkpoint_kind"] for c in js["checkpoints"]] == ["nanoGPT ckpt.pt"] * 4
    sigma = [h["wq_sigma"] for c in js["checkpoints"] for h in c["heads"]
             if (h["layer"], h["head"]) == ("transformer.h.0.attn", 0)]
    assert len(set(sigma)) == 4  # four different models: it trained between them


def _planted_pair(tmp_path):
    """Two nanoGPT checkpoints, one layer of 4 heads: head 0 sees tokens only (its keys
    repeat with the token: tied maxima) and its W^Q grows 4× between them; head 2 sees
    positions only (distinct keys: almost no ties), its W^Q 16× larger, static. Token and
    position embeddings live on disjoint channels with zero mean and fixed norms, so
    LayerNorm keeps them apart."""
    args = dict(n_layer=1, n_head=4, n_embd=32, block_size=32, bias=False, vocab_size=64,
                dropout=0.0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**args))
    tr = model.transformer
    with torch.no_grad():
        for emb, keep in ((tr.wte.weight, slice(0, 16)), (tr.wpe.weight, slice(16, 32))):
            e = torch.zeros_like(emb)
            e[:, keep] = torch.randn(emb.shape[0], 16)
            e[:, keep] -= e[:, keep].mean(1, keepdim=True)
            emb.copy_(e / e.norm(dim=1, keepdim=True) * 4.0)
        w = tr.h[0].attn.c_attn.weight  # [3C, C]: q rows 0..31, k rows 32..63
        for rows, cut in ((slice(0, 8), slice(16, 32)), (slice(32, 40), slice(16, 32)),
                          (slice(16, 24), slice(0, 16)), (slice(48, 56), slice(0, 16))):
            w[rows, cut] = 0.0
        for rows in (slice(0, 8), slice(32, 40), slice(16, 24), slice(48, 56)):
            w[rows] *= 8.0  # logits of order 10 (init std 0.02 gives 0.1)
        w[16:24] *= 16.0  # the distractor: large in both checkpoints
    _nanogpt_ckpt(tmp_path / "a.pt", model, args)
    with torch.no_grad():
        w[0:8] *= 4.0  # the planted head grows
    _nanogpt_ckpt(tmp_path / "b.pt", model, args)
    g = torch.Generator().manual_seed(0)
    torch.save(torch.randint(8, (8, 33), generator=g), tmp_path / "rows.pt")  # 8 symbols


def test_the_planted_growing_tied_head_ranks_first(tmp_path, capsys):
    _planted_pair(tmp_path)
    out = tmp_path / "out"
    assert main(["diagnose", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--data",
                 str(tmp_path / "rows.pt"), "--batches", "4", "--batch-size", "2",
                 "--dtype", "float32", "--out", str(out)]) == 0
    last = json.loads((out / "diagnose.json").read_text())["checkpoints"][1]["heads"]
    by = {h["head"]: h for h in last}
    assert by[0]["tied_ratio"] > 0.5 and by[2]["tied_ratio"] < 0.02  # as planted
    assert by[2]["wq_sigma"] > 2 * by[0]["wq_sigma"]  # the distractor is the larger
    assert [h["head"] for h in last[:1]] == [0]
    assert last[0]["order_rule"].startswith("tied and growing")
    assert "#1 transformer.h.0.attn/0 " in capsys.readouterr().out
