"""flashwatch/diagnosis/checkpoints.py and load.py: every checkpoint kind, written by the
library that writes it in real jobs, loads back into the same weights; the CLI runs on
them end to end; what is not accepted is named in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _helpers import gloo_ranks, on_mesh, tiny_llama

from examples.gpt import GPT, GPTConfig
from flashwatch.cli import main
from flashwatch.diagnosis.load import load_checkpoint

ARGS = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, bias=True,
            dropout=0.0)
BUILDER = ("import torch\nfrom examples.gpt import GPT, GPTConfig\n"
           f"def build():\n    torch.manual_seed(123)\n    return GPT(GPTConfig(**{ARGS!r}))\n")


def _trained(seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**ARGS))


@pytest.fixture
def builder(tmp_path, monkeypatch):
    """`fwbuild:build` in the current directory (no PYTHONPATH), a model of other weights."""
    (tmp_path / "fwbuild.py").write_text(BUILDER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "fwbuild", raising=False)
    return "fwbuild:build"


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    params = [k for k, _ in a.named_parameters()]
    assert params and all(torch.equal(sa[k], sb[k]) for k in params)


@pytest.mark.parametrize("key,prefix", [("model", ""), ("state_dict", "module."),
                                        ("module", "_orig_mod."), (None, "")])
def test_state_dict_files_under_any_key_with_wrapper_prefixes(tmp_path, builder, key, prefix):
    """README's quickstart {"model": ..., "flashwatch": ...}, DDP's module., compile's
    _orig_mod., a bare state dict; FSDP1 puts _fsdp_wrapped_module. inside the path."""
    model = _trained()
    state = {prefix + k.replace(".attn.", ".attn._fsdp_wrapped_module." if key == "module"
                                else ".attn."): v for k, v in model.state_dict().items()}
    torch.save(state if key is None else {key: state, "flashwatch": {"step": 3}},
               tmp_path / "ckpt.pt")
    got = load_checkpoint(str(tmp_path / "ckpt.pt"), builder=builder)
    _same_weights(got.model, model)
    assert got.kind == ("a state dict" if key is None else f"a state dict under {key!r}")


def test_a_state_dict_without_a_builder_says_what_to_pass(tmp_path):
    torch.save({"model": _trained().state_dict(), "flashwatch": {}}, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match=r"is a state dict under 'model'; it needs the model "
                                         r"to load into: pass --model module:function"):
        load_checkpoint(str(tmp_path / "ckpt.pt"))


def test_a_builder_of_another_model_is_named(tmp_path, builder):
    torch.save({"model": tiny_llama().state_dict()}, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match=r"no weights for \d+ of the GPT's"):
        load_checkpoint(str(tmp_path / "ckpt.pt"), builder=builder)


def test_lightning_trainer_checkpoint(tmp_path, builder):
    L = pytest.importorskip("lightning.pytorch")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _trained()

        def training_step(self, batch, _):
            return self.net(batch[:, :-1], batch[:, 1:])[1]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    data = torch.utils.data.DataLoader(torch.randint(64, (4, 17)), batch_size=2)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path)
    trainer.fit(module, data)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    got = load_checkpoint(str(tmp_path / "last.ckpt"), builder=builder)
    assert got.kind == "Lightning .ckpt"
    _same_weights(got.model, module.net)  # "net." taken off every key
    assert not torch.equal(got.model.lm_head.weight, _trained().lm_head.weight)  # it trained


def _dcp_save(mesh, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    model = _trained()
    if mesh.size() > 1:  # FSDP2: each rank writes its shard of every parameter
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    dcp.save({"model": model.state_dict(), "step": 7}, checkpoint_id=os.path.join(out, "dcp"))
    return True


def _dcp_worker(rank, world, init_file, out_dir):
    on_mesh(rank, world, init_file, out_dir, lambda mesh: [("saved", lambda: _dcp_save(
        mesh, out_dir))])


@pytest.mark.parametrize("world", [1, 2])
def test_torch_distributed_checkpoint_folder_without_a_process_group(tmp_path, builder,
                                                                     world):
    assert all(r["saved"] for r in gloo_ranks(_dcp_worker, world, tmp_path))
    assert not torch.distributed.is_initialized()
    got = load_checkpoint(str(tmp_path / "dcp"), builder=builder)
    _same_weights(got.model, _trained())
    assert got.kind.startswith("torch.distributed.checkpoint")


def test_sharded_safetensors_from_save_pretrained(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    got = load_checkpoint(str(tmp_path / "hf"))
    _same_weights(got.model, model)
    assert got.kind == f"Hugging Face folder ({len(shards)} weight files)"
    # the same shards without config.json, into a model built from a config
    (tmp_path / "cfg").mkdir()
    os.rename(tmp_path / "hf" / "config.json", tmp_path / "cfg" / "config.json")
    got = load_checkpoint(str(tmp_path / "hf"), builder=str(tmp_path / "cfg"))
    _same_weights(got.model, model)
    assert got.kind == f"safetensors ({len(shards)} files)"


def test_cli_on_a_state_dict_with_a_builder(tmp_path, builder, capsys):
    torch.save({"model": {"_orig_mod." + k: v for k, v in _trained().state_dict().items()}},
               tmp_path / "ckpt.pt")
    torch.save(torch.randint(64, (2, 17)), tmp_path / "rows.pt")
    assert main(["diagnose", "ckpt.pt", "--model", builder, "--data", "rows.pt",
                 "--batches", "2", "--out", "out"]) == 0
    (res,) = json.loads((tmp_path / "out" / "diagnose.json").read_text())["checkpoints"]
    assert (res["checkpoint_kind"], res["model_class"]) == ("a state dict under 'model'", "GPT")
    assert "GPT from a state dict under 'model'" in capsys.readouterr().out


def test_unknown_folders_and_files_are_named_in_one_line(tmp_path, capsys):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "weights.npz").write_bytes(b"")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "d.txt").write_text("hello")
    for bad, found in (("stuff", "holds ['weights.npz']"), ("junk.pt", "cannot read it")):
        assert main(["diagnose", str(tmp_path / bad), "--data", str(tmp_path / "d.txt")]) == 2
        err = capsys.readouterr().err
        assert found in err and "accepted: a Hugging Face folder" in err
        assert err.count("\n") == 1, err
