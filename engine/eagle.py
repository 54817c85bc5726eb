"""EAGLE-style feature-head drafter (EAGLE 2401.15077; dynamic tree with a bounded frontier, EAGLE-2 2406.16858).

The head is one decoder layer (the target families' `Attention` + SwiGLU MLP from `engine.model`) over a
fusion of the target feature f_t (final hidden state after the norm) and the embedding of the next token:

    u_t   = fc([f_t ; emb(x_{t+1})])              [.., 2D] -> [.., D]
    f^_t+1 = layer(u_t)                           predicted target feature of position t+1
    draft logits = lm_head(f^_t+1)                the target's frozen lm_head (and embeddings): not saved

`FeatureHead` holds the shared machinery (layer, plain and cached forward, save/load); `EagleHead` is the
EAGLE fusion, `engine.mtp.MTPHead` the DeepSeek-V3 MTP module (same drafter, see engine/mtp.py).

Alignment of the head's own paged KV cache with the committed sequence (lazy catch-up, like
`ModelDrafter`, but fed with the target's features handed in by the engine):

    committed tokens      x_0   x_1   ...  x_{n-2}   x_{n-1} = root
    target features       f_0   f_1   ...  f_{n-2}                       (f_{n-1}: only after verification)
    head position t       (f_t, x_{t+1}) for t = 0 .. n-2   -> n-1 committed head slots
    head output at n-2    f^_{n-1}: the root's predicted feature -> depth-1 children
    tree node at depth d  head position n-2+d, input (feature of its parent, its own token)

At start the engine passes f_0..f_{n-2} (the prompt minus its last token); at commit the true features
of every verified node (`target_hidden[0]` = root, `target_hidden[accepted]`), so the positions of the
root and the accepted nodes are recomputed with true features at the next draft: the committed head
KV never holds a drafted feature, and tree nodes only ever live in scratch slots (released at commit).
A sequence with no known feature yet (one-token prompt) drafts nothing in its first round.

Tree: depth by depth, top-W children per frontier node, the `frontier` most probable new nodes kept
per depth (deterministic children) or W i.i.d. children per expanded node with whole sibling groups
(drafted children, `draft_probs` filled: see engine.drafters). With deterministic children the whole
expanded pool (<= 64 nodes) is then re-ranked (EAGLE-2): λ > 0 with an expert predictor ->
`select_expert_aware` on `predicted_experts`; otherwise `max_verify` keeps the most probable paths.
Without a predictor λ is ignored (as in `ModelDrafter`).

Shape letters: B=batch T=tokens N=tree nodes D=hidden V=vocab L=MoE layers E=experts.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file
from torch import nn

from .batching import PackItem, chain_item, pack
from .checkpoint import save_module_folder
from .config import ModelConfig, parse_config
from .draft_tree import DraftTree, ancestor_mask
from .drafters import MAX_TREE_NODES, TreeGrowth
from .expert_predictor import ExpertPredictor, annotate_tree, select_verified
from .kv_cache import PagedKVCache
from .model import DecoderLayer, ForwardBatch, Model, rope_cos_sin
from .sampling import SamplingParams
from .spec import MAX_DEPTH, SpecConfig


# ---------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class HeadConfig:
    """Sizes of a feature head; attention geometry and RoPE follow the target's."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    @staticmethod
    def for_target(target: ModelConfig, intermediate_size: int) -> HeadConfig:
        return HeadConfig(
            hidden_size=target.hidden_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            intermediate_size=intermediate_size,
            vocab_size=target.vocab_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
        )

    def layer_config(self) -> ModelConfig:
        """A one-layer dense (llama) `ModelConfig` for `engine.model.DecoderLayer`."""
        return parse_config(
            dict(
                model_type="llama",
                vocab_size=self.vocab_size,
                hidden_size=self.hidden_size,
                intermediate_size=self.intermediate_size,
                num_hidden_layers=1,
                num_attention_heads=self.num_heads,
                num_key_value_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                rms_norm_eps=self.rms_norm_eps,
                rope_theta=self.rope_theta,
                max_position_embeddings=self.max_position_embeddings,
            )
        )


# ---------------------------------------------------------------------------------------------- heads
class FeatureHead(nn.Module):
    """One decoder layer over `fuse(features, token_emb)`; subclasses define `fuse` and `readout`."""

    model_type: ClassVar[str] = ""
    feature_space: ClassVar[str] = ""  # what its outputs mean (an ExpertPredictor's `input` must match)

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layer = DecoderLayer(cfg.layer_config(), 0)

    def fuse(self, features: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """features, token_emb [..., D] -> layer input [..., D]."""
        raise NotImplementedError

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        """Head output [..., D] -> what the target's lm_head reads [..., D]."""
        return out

    def _block(self, x: torch.Tensor, attend) -> torch.Tensor:
        layer = self.layer
        h = x + attend(layer.input_layernorm(x))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def forward(self, features: torch.Tensor, token_emb: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Causal forward without cache (training): features, token_emb [B, T, D] -> out [B, T, D].

        Row t is the input (f_t, emb(x_{t+1})) at position start + t."""
        cfg = self.config
        x = self.fuse(features, token_emb)
        pos = torch.arange(start, start + x.shape[1], device=x.device)
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, x.dtype)
        return self._block(x, lambda y: self.layer.self_attn.forward_plain(y, cos, sin))

    def forward_cached(
        self, features: torch.Tensor, token_emb: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache
    ) -> torch.Tensor:
        """Packed forward over the head's paged KV (one layer): features, token_emb [N, D] -> out [N, D]."""
        cfg = self.config
        x = self.fuse(features, token_emb)
        cos, sin = rope_cos_sin(batch.positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        half = cfg.head_dim // 2
        sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # the cached path's RoPE (apply_rope_signed)
        return self._block(x, lambda y: self.layer.self_attn.forward_cached(y, cos, sin_signed, batch, kv, 0))

    def drop_inference_cache(self) -> None:
        """Forget the fused qkv weights `Attention` builds under no_grad (call after a weight update)."""
        self.layer.self_attn.__dict__.pop("_qkv", None)


class EagleHead(FeatureHead):
    """EAGLE (2401.15077 §4.1): fc([f_t ; emb(x_{t+1})]) -> decoder layer -> f^_{t+1}; logits = lm_head(f^)."""

    model_type: ClassVar[str] = "expertspec_eagle"
    feature_space: ClassVar[str] = "eagle"

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)

    def fuse(self, features: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([features, token_emb.to(features.dtype)], dim=-1))


# ---------------------------------------------------------------------------------------------- save / load
def save_head(head: FeatureHead, path: str | os.PathLike, target: Model, dtype: torch.dtype = torch.bfloat16,
              extra: dict | None = None) -> Path:  # fmt: skip
    """HF-like folder: config.json (`model_type` expertspec_eagle / expertspec_mtp) + model.safetensors.

    Only the head's own weights are saved; embeddings and lm_head are the target's."""
    tcfg = target.config
    config = {
        "model_type": head.model_type,
        **asdict(head.config),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "target": {"model_type": tcfg.model_type, "hidden_size": tcfg.hidden_size,
                   "vocab_size": tcfg.vocab_size, "num_layers": tcfg.num_layers,
                   "weights_sha256": target_digest(target)},
        **(extra or {}),
    }  # fmt: skip
    return save_module_folder(path, config, head, dtype)


def target_digest(target: Model) -> str | None:
    """SHA-256 (16 hex digits) of the target checkpoint's *.safetensors files; None for an in-memory model.

    A head is only valid for the exact weights it was trained on (it regresses their features)."""
    if target.path is None:
        return None
    digest = hashlib.sha256()
    for file in sorted(Path(target.path).glob("*.safetensors")):
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def load_head(path: str | os.PathLike, target: Model, cls: type[FeatureHead]) -> FeatureHead:
    """Load a head folder of class `cls` for `target` (its device and dtype); checks the pairing: sizes,
    and the target checkpoint's digest when both sides know it (a retrained target needs retrained heads)."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    raw = json.loads(file.read_text())
    if raw.get("model_type") != cls.model_type:
        raise ValueError(f"{path} holds a {raw.get('model_type')!r} model, expected {cls.model_type!r}")
    fields = {k: raw[k] for k in HeadConfig.__dataclass_fields__ if k in raw}
    cfg = HeadConfig(**fields)
    tcfg = target.config
    if (cfg.hidden_size, cfg.vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
        raise ValueError(
            f"{path} was trained for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}, the target has "
            f"hidden {tcfg.hidden_size} / vocab {tcfg.vocab_size}"
        )
    trained_on = raw.get("target", {}).get("weights_sha256")
    if trained_on is not None and target.path is not None and trained_on != target_digest(target):
        raise ValueError(
            f"{path} was trained on another target checkpoint (weights {trained_on}, {target.path} has "
            f"{target_digest(target)}): retrain the heads with `python -m engine.train_heads`"
        )
    head = cls(cfg)
    state = load_file(str(path / "model.safetensors"))
    head.load_state_dict({k: v.float() for k, v in state.items()})
    return head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def load_eagle_head(path: str | os.PathLike, target: Model) -> EagleHead:
    """`zoo/eagle-head` -> EagleHead on the target's device and dtype."""
    return load_head(path, target, EagleHead)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- drafter
DraftRequest = tuple[int, list[int], SpecConfig, SamplingParams, torch.Generator]  # the engine's draft args


@dataclass
class _HeadSeq:
    length: int = 0  # committed tokens the state accounts for (len(tokens) at the last start/commit)
    cached: int = 0  # head positions with committed K/V
    pending_features: list[torch.Tensor] = field(default_factory=list)  # true target features not yet fed
    pending_tokens: list[int] = field(default_factory=list)  # x_{t+1} paired with each pending feature
    root_feature: torch.Tensor | None = None  # [D] head output at the last cached position
    fed_slots: dict[int, int] = field(default_factory=dict)  # tree node -> scratch slot (this round)


@dataclass
class _Round:
    """One request's drafting round inside `draft_many`."""

    seq_id: int
    spec: SpecConfig
    growth: TreeGrowth
    feature: dict[int, torch.Tensor]  # node -> head output (its predicted feature) [D]


class EagleDrafter:
    """A `FeatureHead` over a frozen target as an `engine.drafters.Drafter` (see the module docstring).

    predictor: optional `ExpertPredictor` trained on this head's features; fills
    `tree.predicted_experts` when λ > 0 so the node selection is expert-aware (EcoSpec 2607.12696).
    """

    def __init__(
        self,
        head: FeatureHead,
        target: Model,
        predictor: ExpertPredictor | None = None,
        block_size: int = 16,
        num_blocks: int = 256,
    ) -> None:
        if head.config.hidden_size != target.config.hidden_size or head.config.vocab_size != target.vocab_size:
            raise ValueError("the feature head was built for another target (hidden size / vocabulary differ)")
        if predictor is not None and predictor.config.input != head.feature_space:
            raise ValueError(
                f"the expert predictor was trained on {predictor.config.input!r} features, this head makes "
                f"{head.feature_space!r} features"
            )
        self.head = head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.head.drop_inference_cache()
        self.target = target
        self.predictor = None if predictor is None else predictor.to(target.device).eval().requires_grad_(False)
        self.block_size = block_size
        self.kv = self._new_cache(num_blocks)
        self.seqs: dict[int, _HeadSeq] = {}

    def _new_cache(self, num_blocks: int) -> PagedKVCache:
        cfg = self.head.config
        t = self.target
        return PagedKVCache(1, cfg.num_kv_heads, cfg.head_dim, num_blocks, self.block_size, t.dtype, t.device)

    def prepare(self, lengths: list[int]) -> None:
        """Size the cache for sequences of these maximal lengths (+ one round's scratch each: one
        allocation per depth, plus the leaves' features)."""
        bs = self.block_size
        scratch = MAX_DEPTH + 1 + -(-MAX_TREE_NODES // bs)
        need = sum(-(-n // bs) + scratch for n in lengths)
        if need > self.kv.num_blocks:
            self.kv.check_quiescent()
            self.kv = self._new_cache(need)

    # ------------------------------------------------------------------ protocol: alignment
    def start(self, seq_id: int, tokens: list[int], target_hidden: torch.Tensor | None = None) -> None:
        """target_hidden [len(tokens) - 1, D]: the target's features of the prompt minus its last token."""
        n = len(tokens) - 1
        if n > 0 and (target_hidden is None or target_hidden.shape[0] != n):
            got = None if target_hidden is None else tuple(target_hidden.shape)
            raise ValueError(f"EagleDrafter.start needs the target's features [{n}, D] of the prompt, got {got}")
        self.kv.add_sequence(seq_id)
        seq = self.seqs[seq_id] = _HeadSeq(length=len(tokens))
        if n > 0:
            seq.pending_features.append(target_hidden)
            seq.pending_tokens.extend(tokens[1:])

    def commit(
        self,
        seq_id: int,
        tokens: list[int],
        tree: DraftTree,
        accepted: list[int],
        target_hidden: torch.Tensor | None = None,
    ) -> None:
        """Queue (true feature, next token) for the root and the accepted nodes; release the scratch.

        target_hidden [tree.num_nodes, D]: the target's features of the verified nodes, in tree order."""
        seq = self.seqs[seq_id]
        new = tokens[seq.length :]  # accepted + recovered/bonus (fewer when the request just finished)
        self.kv.release_scratch(seq_id)
        seq.fed_slots = {}
        if not new:
            return
        if target_hidden is None:
            raise ValueError("EagleDrafter.commit needs the target's features of the verified nodes")
        rows = torch.tensor([0, *accepted[: len(new) - 1]], device=target_hidden.device)
        seq.pending_features.append(target_hidden[rows])
        seq.pending_tokens.extend(new)
        seq.length = len(tokens)

    def finish(self, seq_id: int) -> None:
        if seq_id in self.seqs:
            self.kv.release(seq_id)
            del self.seqs[seq_id]

    # ------------------------------------------------------------------ forward helpers
    def _run(self, items: list[PackItem], features: torch.Tensor) -> torch.Tensor:
        """One packed head forward: items' tokens with features [N, D] (packed order) -> outputs [N, D]."""
        batch = pack(items, self.target.device)
        token_emb = self.target.model.embed_tokens(batch.input_ids)
        return self.head.forward_cached(features.to(self.target.dtype), token_emb, batch, self.kv)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """Head outputs [n, D] -> draft logits [n, V] (float32)."""
        return self.target.lm_head(self.head.readout(out)).float()

    def catch_up(self, seq_ids: list[int]) -> list[torch.Tensor | None]:
        """Feed every queued (feature, token) pair of these sequences (one packed forward, causal chunk
        per sequence); return each root's predicted feature [D] (None before any feature is known)."""
        items, feats, owners = [], [], []
        for seq_id in seq_ids:
            seq = self.seqs[seq_id]
            if not seq.pending_tokens:
                continue
            k = len(seq.pending_tokens)
            self.kv.reserve(seq_id, seq.cached + k)
            slots = self.kv.slots(seq_id, range(seq.cached + k))
            items.append(chain_item(seq.pending_tokens, slots[: seq.cached], slots[seq.cached :]))
            feats.append(torch.cat(seq.pending_features).to(self.target.device))  # [k, D]
            owners.append(seq)
        if items:
            out = self._run(items, torch.cat(feats))
            end = 0
            for seq, f in zip(owners, feats):
                end += f.shape[0]
                seq.root_feature = out[end - 1]
                seq.cached += f.shape[0]
                seq.pending_features, seq.pending_tokens = [], []
        return [self.seqs[s].root_feature for s in seq_ids]

    def _expand_item(self, r: _Round, nodes: list[int]) -> PackItem:
        """PackItem running tree `nodes`: each sees the committed head slots and its fed ancestors."""
        seq = self.seqs[r.seq_id]
        g = r.growth
        ctx = self.kv.slots(r.seq_id, range(seq.cached))  # [c] committed head slots
        c = ctx.shape[0]
        write = self.kv.scratch_slots(r.seq_id, len(nodes))
        for i, s in zip(nodes, write.tolist()):
            seq.fed_slots[i] = s
        fed = sorted(seq.fed_slots)
        read = torch.cat([ctx, torch.tensor([seq.fed_slots[i] for i in fed], dtype=torch.long)])
        mask = torch.zeros(len(nodes), read.shape[0], dtype=torch.bool)
        mask[:, :c] = True
        mask[:, c:] = ancestor_mask(torch.tensor(g.par))[torch.tensor(nodes)][:, torch.tensor(fed)]
        return PackItem(
            tokens=torch.tensor([g.tok[i] for i in nodes]),
            positions=torch.tensor([c - 1 + g.dep[i] for i in nodes]),  # depth d -> head position n-2+d
            write_slots=write,
            read_slots=read,
            mask=mask,
        )

    def _expand(self, work: list[tuple[_Round, list[int]]]) -> list[torch.Tensor]:
        """One packed head forward over several trees' `nodes` (inputs: parents' features + own tokens);
        records each node's output as its feature; returns the outputs [len(nodes), D] per entry."""
        items = [self._expand_item(r, nodes) for r, nodes in work]
        parents = torch.stack([r.feature[r.growth.par[i]] for r, nodes in work for i in nodes])  # [n, D]
        out = self._run(items, parents)
        res, off = [], 0
        for r, nodes in work:
            res.append(out[off : off + len(nodes)])
            r.feature.update({i: out[off + j] for j, i in enumerate(nodes)})
            off += len(nodes)
        return res

    # ------------------------------------------------------------------ protocol: draft
    def draft(
        self, seq_id: int, tokens: list[int], spec: SpecConfig, params: SamplingParams, generator: torch.Generator
    ) -> DraftTree:
        return self.draft_many([(seq_id, tokens, spec, params, generator)])[0]

    @torch.inference_mode()
    def draft_many(self, requests: list[DraftRequest]) -> list[DraftTree]:
        """Draft trees for several requests with one head forward per depth (plus one catch-up).

        Each tree's `draft_seconds` is the batched drafting time (one cost shared by the batch)."""
        t0 = time.perf_counter()
        for seq_id, tokens, *_ in requests:
            if self.seqs[seq_id].length != len(tokens):
                raise RuntimeError(f"EagleDrafter out of step on sequence {seq_id}: "
                                   f"{self.seqs[seq_id].length} tokens accounted for, got {len(tokens)}")  # fmt: skip
            self.seqs[seq_id].fed_slots = {}
        roots = self.catch_up([seq_id for seq_id, *_ in requests])
        live = [i for i, (req, root) in enumerate(zip(requests, roots)) if root is not None and req[2].depth > 0]
        root_logits = self._logits(torch.stack([roots[i] for i in live])) if live else None
        rounds: dict[int, _Round] = {}
        for j, i in enumerate(live):
            seq_id, tokens, spec, params, generator = requests[i]
            drafted = spec.use_drafted_children and not params.greedy
            # deterministic children are re-ranked after growth (EAGLE-2): grow the whole bounded pool
            grow_spec = spec if drafted else replace(spec, max_verify=None)
            growth = TreeGrowth(tokens[-1], root_logits[j], grow_spec, params, generator)
            rounds[i] = _Round(seq_id, spec, growth, {0: roots[i]})
        depth = 1
        while True:
            work = [(r, nxt) for r in rounds.values() if not r.growth.done and (nxt := r.growth.grow(depth))]
            if not work:
                break
            for (r, nodes), out in zip(work, self._expand(work)):
                logits = self._logits(out)
                r.growth.node_logits = {i: logits[j] for j, i in enumerate(nodes)}
                r.growth.frontier = nodes
            depth += 1
        trees = [DraftTree.root_only(tokens[-1]) for _, tokens, *_ in requests]
        for i, r in rounds.items():
            trees[i] = r.growth.tree(self.target.vocab_size)
        if self.predictor is not None:
            self._predict_experts(trees, {i: r for i, r in rounds.items() if r.spec.lam > 0 and not r.growth.drafted})
        for i, r in rounds.items():
            trees[i] = select_verified(trees[i], r.spec, r.growth.drafted)
        seconds = time.perf_counter() - t0
        for tree in trees:
            tree.draft_seconds = seconds
        return trees

    def _predict_experts(self, trees: list[DraftTree], wanted: dict[int, _Round]) -> None:
        """λ > 0: every node's predicted feature (one more head step for unexpanded nodes) -> the
        predictor's top-r experts per MoE layer in `tree.predicted_experts` [N, L, E]."""
        work = [(r, [i for i in range(1, len(r.growth.tok)) if i not in r.feature]) for r in wanted.values()]
        work = [(r, nodes) for r, nodes in work if nodes]
        if work:
            self._expand(work)
        for t, r in wanted.items():
            annotate_tree(trees[t], torch.stack([r.feature[i] for i in range(len(r.growth.tok))]), self.predictor)


def load_feature_drafter(
    path: str | os.PathLike, target: Model, predictor: str | os.PathLike | ExpertPredictor | None = None, **kv_options
) -> EagleDrafter:
    """A head folder (`zoo/eagle-head` or `zoo/mtp-head`) -> EagleDrafter / MTPDrafter over `target`,
    optionally with an expert predictor (folder or module) for λ > 0."""
    from .expert_predictor import load_expert_predictor
    from .mtp import MTPDrafter, MTPHead

    config = Path(path) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if isinstance(predictor, (str, os.PathLike)):
        predictor = load_expert_predictor(predictor, target.device)
    if model_type == EagleHead.model_type:
        return EagleDrafter(load_head(path, target, EagleHead), target, predictor, **kv_options)
    if model_type == MTPHead.model_type:
        return MTPDrafter(load_head(path, target, MTPHead), target, predictor, **kv_options)
    raise ValueError(f"{path} is not a feature-head folder (model_type {model_type!r})")
