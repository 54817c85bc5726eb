"""Hugging Face checkpoint folders <-> `engine.Model`.

A folder holds `config.json`, one or more `*.safetensors` (optionally with `model.safetensors.index.json`)
and optionally `tokenizer.json`. Expert weights are accepted per expert (the hub layout:
`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3.weight`) or
already stacked (`mlp.experts.gate_up_proj [E, 2F, D]`, `mlp.experts.down_proj [E, D, F]`), and are
saved in the hub layout so `transformers` loads our folders too.

Every check (config, files, key set, shapes) runs before a `Model` is returned; a failed load leaves
nothing behind. `save_model` writes into a temporary folder and renames it into place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.models import gpt_oss
from engine.models.config import ModelConfig, load_config, parse_config
from engine.models.layout import use_decode_layout
from engine.models.transformer import Model

_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_PROJ_ROLE = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_UNGATED_SHARED = ("deepseek_v3", "glm4_moe")  # hub `mlp.shared_experts.*` <-> our `mlp.shared_expert.*`


class CheckpointError(ValueError):
    """A checkpoint folder whose weights do not match its config."""


def check_state(
    state: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    path: str | os.PathLike,
    what: str = "weights",
    error: type[Exception] = CheckpointError,
    ignore: Callable[[str], bool] = lambda key: False,
    name: Callable[[str], str] = lambda key: key,
) -> None:
    """Every `expected` tensor (meta tensors of the module to load) is in `state` with its shape, and nothing else
    is (keys `ignore` accepts aside); else `error`, "{path}: {what} missing [...]; unexpected [...]" (first 8 of each,
    in checkpoint names via `name`) or "{path}: shape mismatch for <key>", before any weight is loaded."""

    def first(keys: list[str]) -> str:
        return f"{[name(k) for k in keys[:8]]}{'...' if len(keys) > 8 else ''}"

    missing = sorted(set(expected) - set(state))
    unexpected = sorted(k for k in set(state) - set(expected) if not ignore(k))
    if missing or unexpected:
        raise error(f"{path}: {what} missing {first(missing)}; unexpected {first(unexpected)}")
    for key, meta in expected.items():
        if tuple(state[key].shape) != tuple(meta.shape):
            raise error(f"{path}: shape mismatch for {name(key)}: checkpoint "
                        f"{tuple(state[key].shape)}, config implies {tuple(meta.shape)}")  # fmt: skip


def read_weights(cfg: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors, dequantised per its `quantization_config`: block-scaled FP8 (DeepSeek-V3's release:
    `X.weight` e4m3 with `X.weight_scale_inv` [ceil(out/b0), ceil(in/b1)], W = W_fp8 * scale per block) or
    gpt_oss MXFP4 experts (engine.models.gpt_oss). Any other quantisation is a clear error."""
    quant = cfg.raw.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method is not None and method != "fp8" and not (method == "mxfp4" and cfg.model_type == "gpt_oss"):
        raise CheckpointError(f"{path}: {method!r}-quantised weights are not supported for {cfg.model_type} "
                              "(block-FP8 and gpt_oss MXFP4 experts are dequantised on load)")  # fmt: skip
    raw = _read_safetensors(path)
    if method != "fp8":
        return raw
    b0, b1 = quant.get("weight_block_size") or (128, 128)
    out = {}
    for key, t in raw.items():
        if key.endswith(".weight_scale_inv"):
            continue
        scale = raw.get(key.removesuffix(".weight") + ".weight_scale_inv") if key.endswith(".weight") else None
        if scale is not None:
            rows, cols = t.shape
            if tuple(scale.shape) != (-(-rows // b0), -(-cols // b1)):
                raise CheckpointError(f"{path}: {key} {tuple(t.shape)} has scales {tuple(scale.shape)}, expected "
                                      f"{(-(-rows // b0), -(-cols // b1))} for {b0}x{b1} blocks")  # fmt: skip
            full = scale.float().repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
            t = t.float() * full
        out[key] = t
    return out


def split_extra_layers(cfg: ModelConfig, raw: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(decoder weights, weights of layers >= num_hidden_layers): DeepSeek-V3 / GLM-4.5 store their MTP
    modules as extra `model.layers.{L + k}` (engine.models.mtp loads them as a drafter)."""
    main, extra = {}, {}
    for key, t in raw.items():
        m = _LAYER.match(key)
        (extra if m and int(m.group(1)) >= cfg.num_layers else main)[key] = t
    return main, extra


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: shards listed in the index are missing: {missing}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as err:
            raise CheckpointError(f"cannot read {file} (truncated or corrupt safetensors?): {err}") from err
    return tensors


def _to_internal(cfg: ModelConfig, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename hub keys to our module names and stack per-expert weights."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    if cfg.model_type == "gpt_oss":  # stacked, biased, maybe MXFP4 experts: their own layout
        try:
            return gpt_oss.hub_to_internal(raw)
        except ValueError as err:
            raise CheckpointError(str(err)) from err
    for key, t in raw.items():
        m = _EXPERT.match(key)
        if m:
            layer, e, proj = int(m.group(1)), int(m.group(2)), m.group(3)
            experts.setdefault((layer, _PROJ_ROLE[proj]), {})[e] = t
            continue
        key = key.replace(".block_sparse_moe.", ".mlp.")
        if cfg.model_type in _UNGATED_SHARED:
            key = key.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
        out[key] = t
    for (layer, role), per_expert in experts.items():
        want = set(range(cfg.num_experts))
        if set(per_expert) != want:
            raise CheckpointError(
                f"layer {layer} {role} weights: experts {sorted(want - set(per_expert))} missing, "
                f"{sorted(set(per_expert) - want)} unexpected"
            )
        shapes = {tuple(t.shape) for t in per_expert.values()}
        if len(shapes) != 1:
            raise CheckpointError(f"layer {layer} {role} weights have differing shapes {sorted(shapes)}")
        out[f"model.layers.{layer}.mlp.experts.{role}"] = torch.stack([per_expert[e] for e in range(cfg.num_experts)])
    for layer in {lay for lay, _ in experts}:
        gate = out.pop(f"model.layers.{layer}.mlp.experts.gate", None)
        up = out.pop(f"model.layers.{layer}.mlp.experts.up", None)
        down = out.pop(f"model.layers.{layer}.mlp.experts.down", None)
        if gate is None or up is None or down is None:
            raise CheckpointError(f"layer {layer}: expert gate/up/down projections incomplete")
        if gate.shape != up.shape:
            raise CheckpointError(f"layer {layer}: expert gate {tuple(gate.shape)} vs up {tuple(up.shape)}")
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = down
    return out


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}  # fmt: skip


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch floating dtype, or its name ("bfloat16", "bf16", "torch.float16", ...)."""
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ValueError(f"dtype must be a torch floating dtype or one of {sorted(DTYPES)}, got {dtype!r}")


def load_model(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32
) -> Model:
    """Load an HF checkpoint folder into an `engine.Model` (eval mode, no grad). dtype: a torch dtype or its
    name ("float32", "bfloat16", "bf16", ...)."""
    dtype = resolve_dtype(dtype)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    cfg = load_config(path)
    state = _to_internal(cfg, split_extra_layers(cfg, read_weights(cfg, path))[0])
    with torch.device("meta"):
        model = Model(cfg)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state.pop("lm_head.weight", None)
    check_state(state, expected, path, ignore=lambda k: k.endswith("rotary_emb.inv_freq"))
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_state_dict({k: state[k].to(dtype) for k in expected}, strict=False, assign=False)
    model = model.to(dtype=dtype)
    model.eval().requires_grad_(False)
    use_decode_layout(model)  # CPU weights stored [in, out]: gemv at the read bandwidth (engine.models.layout)
    model.path = str(path)
    tok = path / "tokenizer.json"
    if tok.is_file():
        from tokenizers import Tokenizer

        model.tokenizer = Tokenizer.from_file(str(tok))
    return model


def init_weights(model: Model, seed: int = 0, std: float = 0.02) -> Model:
    """Deterministic random initialisation (normal(0, std) matrices, ones for norms)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def build_model(hf_config: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Model:
    """A randomly initialised `Model` from an HF config dict (must contain `model_type`)."""
    model = init_weights(Model(parse_config(hf_config)), seed)
    return model.to(dtype)


def hub_state_dict(model: Model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Our parameters renamed to the hub layout (per-expert keys) of the model's family."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    mixtral = cfg.model_type == "mixtral"
    if cfg.model_type == "gpt_oss":
        state = {k: t.detach().to("cpu") for k, t in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return {k: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
                for k, t in gpt_oss.internal_to_hub(state).items()}  # fmt: skip
    for key, t in model.state_dict().items():
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if cfg.tie_word_embeddings and key == "lm_head.weight":
            continue
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key[: -len("mlp.experts.gate_up_proj")]
            F_ = t.shape[1] // 2
            for e in range(t.shape[0]):
                names = ("w1", "w3") if mixtral else ("gate_proj", "up_proj")
                base = f"{prefix}{'block_sparse_moe' if mixtral else 'mlp'}.experts.{e}."
                out[f"{base}{names[0]}.weight"] = t[e, :F_].contiguous()
                out[f"{base}{names[1]}.weight"] = t[e, F_:].contiguous()
            continue
        if key.endswith("mlp.experts.down_proj"):
            prefix = key[: -len("mlp.experts.down_proj")]
            for e in range(t.shape[0]):
                base = f"{prefix}{'block_sparse_moe' if mixtral else 'mlp'}.experts.{e}."
                out[f"{base}{'w2' if mixtral else 'down_proj'}.weight"] = t[e].contiguous()
            continue
        if mixtral:
            key = key.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        if cfg.model_type in _UNGATED_SHARED:
            key = key.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        out[key] = t.contiguous()
    return out


@contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `path` in one rename (with the usual
    file permissions), on any error it is removed: a reader never sees a half-written checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        umask = os.umask(0)  # mkdtemp made the folder 0700
        os.umask(umask)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_module_folder(path: str | os.PathLike, config: dict, module: torch.nn.Module, dtype: torch.dtype) -> Path:
    """An HF-like folder for a non-HF module (heads, predictors): config.json + model.safetensors."""
    with atomic_folder(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in module.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Path(path)


def save_model(
    model: Model,
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    tokenizer_json: str | os.PathLike | None = None,
    extra_files: dict[str, str] | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write an HF folder (config.json, model.safetensors, optional tokenizer.json) atomically. extra_tensors: more
    hub-named tensors for model.safetensors (an MTP module's `model.layers.{num_hidden_layers}.*`)."""
    path = Path(path)
    with atomic_folder(path) as tmp:
        cfg = model.config
        raw = dict(cfg.raw)
        raw.pop("quantization_config", None)  # weights are saved dequantised (gpt_oss MXFP4)
        if not (raw.get("rope_parameters") or raw.get("rope_scaling")):
            raw["rope_parameters"] = {
                "rope_theta": cfg.rope_theta,
                "rope_type": cfg.rope_type,
                **dict(cfg.rope_scaling),
            }
        if dtype is not None:
            raw["torch_dtype"] = raw["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True))
        state = hub_state_dict(model, dtype)
        clash = sorted(set(state) & set(extra_tensors or {}))
        if clash:
            raise ValueError(f"extra_tensors would overwrite the model's own {clash[:4]}")
        state.update(extra_tensors or {})
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer_json is not None:
            shutil.copy(tokenizer_json, tmp / "tokenizer.json")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return path
