"""Hugging Face folders: the architecture the folder holds, and a deterministic objective.

The class loaded is the one that saved the folder (config.architectures[0]: BertModel,
BertForMaskedLM, LlamaForCausalLM, T5ForConditionalGeneration ...), so layer names are
the ones `fw.watch` gives on the user's own model (both name sites with `find_sites`),
and no head is made up: a weight the folder lacks is an error, never a random init.

The backward needs a loss; `objective` picks the model's own (its name is reported):
  causal LM (…ForCausalLM, …LMHeadModel)   next-token cross-entropy of the row
  masked LM (…ForMaskedLM)                 its MLM head on MASK_RATE of the positions,
                                           drawn with a fixed seed, replaced by the
                                           tokenizer's mask token (kept if it has none)
  seq2seq (config.is_encoder_decoder)      labels = the row shifted by one token
  no head (BertModel, encoders)            the same fixed-seed MLM, read out through the
                                           input embeddings (tied: logits = h · Eᵀ),
                                           as BERT's pretraining decoder is tied
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flashwatch._checks import missing_extra

MASK_RATE = 0.15  # BERT's
SEED = 0


def transformers_module():
    """transformers, an extra: only Hugging Face checkpoints need it."""
    try:
        import transformers
    except ImportError as e:
        raise missing_extra("transformers", "transformers", "flashwatch diagnose") from e
    return transformers


def model_class(config):
    """The class named by config.architectures[0], else the causal LM or base AutoModel."""
    tf = transformers_module()
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(tf, arch, None) if arch else None
    if cls is not None:
        return cls
    try:
        return tf.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return tf.AutoModel._model_mapping[type(config)]


def load_folder(path: Path) -> nn.Module:
    """The model a save_pretrained folder holds (sharded safetensors included), every
    weight from the folder: ValueError naming the ones it lacks."""
    tf = transformers_module()
    config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    cls = model_class(config)
    model, info = cls.from_pretrained(path, local_files_only=True, attn_implementation="sdpa",
                                      output_loading_info=True)
    missing = list(info.get("missing_keys") or [])
    if missing:
        raise ValueError(f"{path}: {cls.__name__} needs {len(missing)} weights the folder "
                         f"does not hold (first: {sorted(missing)[:3]}); diagnose does not "
                         "measure a randomly initialised head. Save the model with its "
                         "head, or pass --model module:function returning the model to use")
    return model


def build_from_config(path: Path) -> nn.Module:
    """An empty model (for a state dict to fill) of the class a config names."""
    tf = transformers_module()
    config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    cls = model_class(config)
    config._attn_implementation = "sdpa"
    return cls(config)


def head_kind(model: nn.Module) -> str:
    """'causal', 'masked', 'seq2seq' or 'none' (module docstring)."""
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) and \
            hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        return "seq2seq"
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal"
    if name.endswith("ForMaskedLM"):
        return "masked"
    return "none"


def objective(model: nn.Module, folder: Path | None = None):
    """(loss_fn or None for diagnose's default next-token loss, its description)."""
    kind = head_kind(model)
    if kind == "causal":
        return None, "next-token cross-entropy"
    if kind == "seq2seq":
        def seq2seq(m, batch):
            return m(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss
        return seq2seq, "seq2seq cross-entropy, labels = the row shifted by one (its LM head)"
    mask_id = _mask_token(folder)
    gen = torch.Generator().manual_seed(SEED)
    masked = f"{MASK_RATE:.0%} of positions (seed {SEED}) " + (
        f"replaced by the mask token {mask_id}" if mask_id is not None else
        "predicted in place (no mask token known)")

    def draw(x):
        pick = torch.rand(x.shape, generator=gen) < MASK_RATE
        pick[:, 0] |= ~pick.any(1)  # at least one position per row
        pick = pick.to(x.device)
        return pick, (x.masked_fill(pick, mask_id) if mask_id is not None else x)

    if kind == "masked":
        def mlm(m, batch):
            x = batch[:, :-1]
            pick, inp = draw(x)
            return F.cross_entropy(m(input_ids=inp).logits[pick].float(), x[pick])
        return mlm, f"masked-LM cross-entropy with its own head, {masked}"
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None or getattr(emb, "weight", None) is None:
        raise ValueError(f"{type(model).__name__} has no LM head and no input embeddings to "
                         "read one out through; pass the model with fw.diagnose(model, "
                         "batches, loss_fn=...) from Python")

    def tied(m, batch):
        x = batch[:, :-1]
        pick, inp = draw(x)
        out = m(input_ids=inp)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        logits = h[pick].float() @ m.get_input_embeddings().weight.float().T
        return F.cross_entropy(logits, x[pick])
    return tied, (f"no head in the folder: masked-LM cross-entropy read out through the "
                  f"input embeddings (logits = h · Eᵀ), {masked}")


def _mask_token(folder: Path | None) -> int | None:
    if folder is None or not (folder / "tokenizer_config.json").is_file():
        return None
    tok = transformers_module().AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return tok.mask_token_id
