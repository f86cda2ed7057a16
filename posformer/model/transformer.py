"""The two Transformer models: decoder-only and encoder-decoder, built from shared blocks.

Positions are an explicit tensor (B|1, T) (made by :mod:`posformer.model.positions`) passed down to
every attention layer through an :class:`~posformer.model.context.AttentionContext`; the models
call PE hooks, read ``pe.caps`` and never test a PE's name. Every PE of a model is built by
:func:`~posformer.model.layer_pes.build_layer_pes` and read from its table (``model.layer_pes``).
Incremental decoding keeps its state in a :class:`~posformer.model.cache.KVCache`
(``model.new_cache()``), whose :meth:`KVCache.extend` appends each step's positions and padding for both
models.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor, nn

from posformer.devices import activation_dtype
from posformer.errors import ConfigError
from posformer.model.backends import check_policy
from posformer.model.block import Block, make_norm
from posformer.model.cache import KVCache
from posformer.model.config import ModelConfig
from posformer.model.context import AttentionContext
from posformer.model.layer_pes import LayerPEs, apply_switches, build_layer_pes, check_pe_apply
from posformer.model.parallel import ContextParallel, check_split
from posformer.model.policy import BackendPolicy, FlexFallback
from posformer.model.positions import (
    as_positions,
    continued_positions,
    default_positions,
    document_positions,
    position_limit,
)
from posformer.model.remap import PositionMap, check_position_map
from posformer.model.schedule import DEFAULT_KIND, LayerKind
from posformer.model.size import check_model_fits
from posformer.pe.base import PositionalEncoding

__all__ = ["DecoderOnlyTransformer", "EncoderDecoderTransformer", "KVCache", "build_model"]


class _Base(nn.Module):
    """Shared pieces: PE construction, embeddings, init."""

    cfg: ModelConfig
    #: every PE of the model and where each acts (:mod:`posformer.model.layer_pes`)
    layer_pes: LayerPEs

    @property
    def attention_policy(self) -> BackendPolicy:
        """How attention picks its backends: ``model.attention_backend``, plus any switches set on this
        model (ablations: ``model.attention_policy = BackendPolicy(off=frozenset({"offset"}))``), with
        the model's one record of a FlexAttention failure (:attr:`attention_fallback`)."""
        policy = self.__dict__.get("_attention_policy")
        if policy is None:
            return BackendPolicy(choice=self.cfg.attention_backend, fallback=self._flex_fallback())
        return policy

    @attention_policy.setter
    def attention_policy(self, policy: BackendPolicy) -> None:
        check_policy(policy)
        self.__dict__["_attention_policy"] = replace(policy, fallback=self._flex_fallback())

    @property
    def position_map(self) -> PositionMap | None:
        """The remapping of query/key distances in the decoder's self-attention (:mod:`posformer.model.remap`,
        ``eval.position_map``), or ``None`` (the default: positions as they are)."""
        return self.__dict__.get("_position_map")

    @position_map.setter
    def position_map(self, pm: PositionMap | None) -> None:
        if pm is not None:  # the decoder's self-attention PEs: the place's and its layer kinds'
            kinds = dict.fromkeys(self.cfg.plan("decoder")) if self.cfg.kind == "decoder" else ()
            pes = [self.layer_pes.place("decoder"), *(self.layer_pes.layer("decoder", k) for k in kinds)]
            check_position_map(pm, pes, self.cfg.kind, self.cfg.pe)
        self.__dict__["_position_map"] = pm

    def _flex_fallback(self) -> FlexFallback:
        return self.__dict__.setdefault("_flex_fallback_record", FlexFallback())

    @property
    def attention_fallback(self) -> str | None:
        """Why FlexAttention stopped running for this model under ``auto`` (its later calls took SDPA or
        the materialised paths), or None when it never failed."""
        return self._flex_fallback().reason

    def _build_pes(self) -> None:
        """Build every PE of the model (:func:`~posformer.model.layer_pes.build_layer_pes`) and register
        each under the name checkpoints know it by (``pe``; ``pe_enc``, ``pe_dec``, ``pe_cross``; ``pes``)."""
        self.layer_pes = build_layer_pes(self.cfg)
        for name, module in self.layer_pes.modules(self.cfg.kind):
            setattr(self, name, module)

    def apply_switches(self, step: int, max_steps: int | None = None) -> list[str]:
        """The PEs of training step ``step`` (:func:`~posformer.model.layer_pes.apply_switches`): the
        ``<place>_<kind>`` names of the layer kinds whose PE this call changed."""
        return apply_switches(self, step, max_steps)

    def _contexts(
        self,
        place: str,
        q_pos: Tensor,
        k_pos: Tensor,
        causal: bool,
        padding: Tensor | None,
        segment_ids: Tensor | None = None,
        from_zero: bool = False,
        past: int | None = None,
        centred: bool = False,
    ) -> list[AttentionContext]:
        """One context per layer of ``place`` (layers of one kind share it). ``past``: tokens already in
        the decoding cache; a sliding or chunked kind then sees only the keys its rolling cache keeps.
        ``centred``: queries and keys are both ``0 … T-1`` without a cache, so a PE may move their origin."""
        by_kind: dict[str, AttentionContext] = {}
        plan = self.cfg.plan(place)
        remap = self.position_map if place == "decoder" and causal else None
        for kind in plan:
            if kind.name in by_kind:
                continue
            kp, pad, start, keep = k_pos, padding, 0, None
            kept = kind.span.cached_keys(past) if past is not None else None
            if kept is not None:  # the cache holds the latest ``kept`` keys before the new ones
                n = kept + q_pos.shape[1]
                kp, pad = k_pos[:, -n:], padding[:, -n:] if padding is not None else None
                start, keep = past - kept, kind.span.cached_keys(past + q_pos.shape[1])
            by_kind[kind.name] = self._context(
                self.layer_pes.layer(place, kind),
                q_pos,
                kp,
                causal,
                pad,
                segment_ids,
                from_zero,
                kind=kind,
                key_start=start,
                cache_keep=keep,
                centred=centred and remap is None,  # remapped positions keep their origin
                position_map=remap,
            )
            if place == "decoder" and self.cfg.kind == "decoder":  # the attention probe's record
                by_kind[kind.name].probe = self.__dict__.get("_attention_probe")
        return [by_kind[kind.name] for kind in plan]

    def _embed(
        self, emb: nn.Embedding, pe: PositionalEncoding | None, ids: Tensor, positions: Tensor
    ) -> Tensor:
        x = emb(ids)  # (B, T, D)
        if self.cfg.scale_embedding:
            x = x * math.sqrt(self.cfg.d_model)
        if pe is not None and "embed" in pe.caps.hooks:
            # the PE sees unit-scale token embeddings (the 2017 convention its tables are made for:
            # a unit-amplitude sinusoid next to N(0, 1) tokens) and its output is mapped back to the
            # model's scale; 1 for the 2017 recipe, sqrt(2/d) for decoder-only (docs/results.md, "Parity")
            std = self.cfg.embedding_std
            x = pe.embed(x, positions) if std == 1.0 else pe.embed(x / std, positions) * std
        return self.emb_dropout(x)

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if ".pe" in name or name.startswith("pe"):
                continue  # PEs own their initialisation
            if p.dim() == 2 and "emb" in name.split(".")[0]:
                nn.init.normal_(p, std=self.cfg.token_init_std)  # "torch": x-t's kaiming-normal init_
            elif self.cfg.init == "torch":  # nn.Linear keeps its defaults (kaiming-uniform, a=sqrt(5))
                continue
            elif p.dim() == 2:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias") and "norm" not in name:
                nn.init.zeros_(p)
        for emb in self.modules():
            if isinstance(emb, nn.Embedding) and emb.padding_idx is not None:
                with torch.no_grad():
                    emb.weight[emb.padding_idx].zero_()

    def _new_positions(
        self,
        pe: PositionalEncoding | None,
        ids: Tensor,
        positions: Tensor | None,
        cache: KVCache | None,
        made: bool = False,
        centred: bool = False,
    ) -> Tensor:
        """Positions (B|1, T) of new tokens ``ids`` (B, T), given or the defaults; range-checked by a host
        bound (nothing read) when the model made them: ``0 … T-1``, ``made`` (restarting per document), or
        continuing a cache of such positions (``cache.top``); ``centred``: in a forward that may move their
        origin (:meth:`PositionalEncoding.rotary_origin`)."""
        pos = as_positions(positions) if positions is not None else continued_positions(ids, cache)
        top = None
        if made or (positions is None and (cache is None or cache.positions is None)):
            top = ids.shape[1] - 1
        elif positions is None and cache.top is not None:
            top = cache.top + ids.shape[1]
        if pe is not None:
            pe.check_positions(pos, top, self._compute_dtype(ids), centred=centred)
        if cache is not None:
            cache.top = top  # after the check: a refused step leaves the cache as it was
        return pos

    def _compute_dtype(self, t: Tensor) -> torch.dtype:
        """Attention's dtype on ``t``'s device: autocast's inside an autocast region, else the weights'."""
        return activation_dtype(t.device.type, next(self.parameters()).dtype)

    def _context(
        self,
        pe: PositionalEncoding | None,
        q_pos: Tensor,
        k_pos: Tensor,
        causal: bool,
        padding: Tensor | None,
        segment_ids: Tensor | None = None,
        from_zero: bool = False,
        *,
        kind: LayerKind = DEFAULT_KIND,
        key_start: int = 0,
        cache_keep: int | None = None,
        centred: bool = False,
        position_map: PositionMap | None = None,
    ) -> AttentionContext:
        """The attention context of one forward: ``pe`` only if it acts inside attention;
        ``segment_ids`` (B, Tk): packed documents (block-diagonal attention); ``from_zero``: both
        positions are the defaults ``0 … T-1`` (known here, so attention reads no tensor to learn it);
        ``centred``: they may be measured from the PE's :meth:`PositionalEncoding.rotary_origin`."""
        attn_pe = pe if pe is not None and pe.caps.in_attention else None
        top = k_pos.shape[1] - 1 if from_zero else None  # the model's own positions: nothing read
        origin = 0
        if attn_pe is not None:
            dtype = self._compute_dtype(k_pos)
            attn_pe.check_positions(k_pos, top, dtype, centred=centred)
            origin = attn_pe.rotary_origin(k_pos.shape[1], dtype) if centred else 0
        return AttentionContext(
            attn_pe,
            q_pos,
            k_pos,
            causal=causal,
            key_padding_mask=padding,
            segment_ids=segment_ids,
            chunk_bytes=self.cfg.attention_chunk_mb * 2**20,
            policy=self.attention_policy,
            from_zero=from_zero,
            span=kind.span,
            key_start=key_start,
            temperature=kind.temperature,
            sinks=bool(kind.sinks),
            softcap=kind.knobs.softcap or 0.0,
            cache_keep=cache_keep,
            origin=origin,
            position_map=position_map if attn_pe is not None else None,
        )

    @property
    def max_positions(self) -> int | None:
        """The fewest positions any of the model's PEs can represent (``None``: no PE is limited)."""
        return (position_limit(self) or (None,))[0]

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for m in self.modules():
                if isinstance(m, nn.Embedding):
                    params.pop(id(m.weight), None)
        return sum(p.numel() for p in params.values())


class DecoderOnlyTransformer(_Base):
    """GPT-style causal language model.

    ``forward(input_ids (B, T), positions (B|1, T) | None, attention_mask (B, T) | None, cache,
    segment_ids (B, T) | None, *, parallel=None) -> logits (B, T, V)``; with ``parallel`` (a
    :class:`~posformer.model.parallel.ContextParallel` group) every tensor is this rank's slice of the
    sequence, (B, T/P), and so are the logits (B, T/P, V) (:mod:`posformer.model.parallel`).

    ``segment_ids`` (packed rows: the document of every token) make attention block-diagonal causal
    and, unless ``positions`` are given, restart the positions at every document
    (:func:`~posformer.model.positions.document_positions`): each document's logits are those of the
    document alone. Not with a ``cache`` (packing is for training and scoring).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.kind != "decoder":
            raise ConfigError(f"DecoderOnlyTransformer needs model.kind='decoder', got {cfg.kind!r}.")
        self.cfg = cfg
        check_pe_apply(cfg)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self._build_pes()  # self.pe (and self.pes)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        plan = cfg.plan("decoder")
        self.blocks = nn.ModuleList(
            Block(cfg, cross=False, index=i, kind=plan[i]) for i in range(cfg.n_layers)
        )
        self.norm_f = make_norm(cfg) if cfg.pre_ln else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def new_cache(self) -> KVCache:
        return KVCache.empty(self.cfg.n_layers)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
        segment_ids: Tensor | None = None,
        *,
        parallel: ContextParallel | None = None,
    ) -> Tensor:
        if parallel is not None:
            return self._forward_split(input_ids, positions, attention_mask, segment_ids, parallel, cache)
        from_zero = positions is None and cache is None  # default positions (restarting with documents)
        if segment_ids is not None:
            if cache is not None:
                raise ValueError("segment_ids (packed documents) cannot be combined with a KV cache")
            if segment_ids.shape != input_ids.shape:
                raise ValueError(
                    f"segment_ids must have the shape of input_ids {tuple(input_ids.shape)}, "
                    f"got {tuple(segment_ids.shape)}"
                )
            if positions is None:
                positions = document_positions(segment_ids)  # (B, T)
        centred = from_zero and segment_ids is None  # 0 … T-1 in one forward: may move their origin
        pe = self.layer_pes.place("decoder")
        pos = self._new_positions(pe, input_ids, positions, cache, made=from_zero, centred=centred)
        k_pos, padding = pos, attention_mask  # (B|1, T_past + T), (B, T_past + T) | None
        replay = cache.replay(pe, input_ids, pos, attention_mask) if cache is not None else None
        if replay is not None:  # the grown length changed the PE's rotary tables: run every token again
            every, every_pos, every_pad = replay
            return self.forward(every, every_pos, every_pad, cache)[:, -input_ids.shape[1] :]
        past = cache.length if cache is not None else None
        if cache is not None:
            k_pos, padding = cache.extend(input_ids, pos, attention_mask)
        ctxs = self._contexts("decoder", pos, k_pos, True, padding, segment_ids, from_zero, past, centred)
        x = self._embed(self.tok_emb, pe, input_ids, pos)  # (B, T, D)
        for i, block in enumerate(self.blocks):
            x = block(x, ctxs[i], cache=cache.layers[i] if cache is not None else None)
        return self.lm_head(self.norm_f(x))  # (B, T, V)

    def _forward_split(
        self,
        input_ids: Tensor,
        positions: Tensor | None,
        attention_mask: Tensor | None,
        segment_ids: Tensor | None,
        parallel: ContextParallel,
        cache: KVCache | None,
    ) -> Tensor:
        """This rank's slice of a sequence split across ``parallel`` (:mod:`posformer.model.parallel`):
        ``input_ids`` (B, T/P) and the slices of ``positions``, ``attention_mask``, ``segment_ids`` ->
        logits (B, T/P, V) of its tokens, equal to the unsplit forward's. The positions and masks of the
        whole sequence are gathered (or made: ``0 … T-1``, restarting with documents) for attention."""
        if cache is not None:
            raise ValueError("a split sequence (parallel=...) cannot use a KV cache: decode unsplit")
        check_split(parallel.size, n_heads=self.cfg.n_heads)
        b, local = input_ids.shape
        whole = input_ids.new_zeros(()).expand(b, local * parallel.size)  # (B, T): the shape, no memory
        positions = parallel.gather(as_positions(positions)) if positions is not None else None
        padding, segment_ids = parallel.gather(attention_mask), parallel.gather(segment_ids)
        from_zero = positions is None
        if segment_ids is not None and positions is None:
            positions = document_positions(segment_ids)  # (B, T)
        centred = from_zero and segment_ids is None
        pe = self.layer_pes.place("decoder")
        pos = self._new_positions(pe, whole, positions, None, made=from_zero, centred=centred)  # (B|1, T)
        ctxs = self._contexts("decoder", pos, pos, True, padding, segment_ids, from_zero, None, centred)
        shards = {id(c): parallel.shard(c, self.cfg.n_heads) for c in ctxs}  # layers of a kind share one
        s, e = parallel.local_range(local)
        x = self._embed(self.tok_emb, pe, input_ids, pos[:, s:e])  # (B, T/P, D) at global positions
        for i, block in enumerate(self.blocks):
            x = block(x, shards[id(ctxs[i])])
        return self.lm_head(self.norm_f(x))  # (B, T/P, V)


class EncoderDecoderTransformer(_Base):
    """The 2017 encoder-decoder Transformer (post-LN by default).

    ``forward(src (B, S), tgt (B, T), src_mask (B, S), tgt_mask (B, T)) -> logits (B, T, V)``;
    masks are True for real tokens.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.kind != "encoder_decoder":
            raise ConfigError(
                f"EncoderDecoderTransformer needs model.kind='encoder_decoder', got {cfg.kind!r}."
            )
        self.cfg = cfg
        check_pe_apply(cfg)
        src_vocab = cfg.src_vocab_size or cfg.vocab_size
        if cfg.share_src_tgt_embedding and src_vocab != cfg.vocab_size:
            raise ConfigError(
                f"model.share_src_tgt_embedding=true needs one vocabulary, but src_vocab_size={src_vocab} "
                f"and vocab_size={cfg.vocab_size}. Use a joint vocabulary or share_src_tgt_embedding=false."
            )
        self.tgt_emb = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.src_emb = (
            self.tgt_emb
            if cfg.share_src_tgt_embedding
            else nn.Embedding(src_vocab, cfg.d_model, padding_idx=cfg.pad_id)
        )
        self._build_pes()  # self.pe_enc, self.pe_dec, self.pe_cross (and self.pes)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        enc, dec, cross = cfg.plan("encoder"), cfg.plan("decoder"), cfg.plan("cross")
        self.encoder = nn.ModuleList(
            Block(cfg, cross=False, index=i, kind=enc[i]) for i in range(cfg.n_encoder_layers)
        )
        self.decoder = nn.ModuleList(
            Block(cfg, cross=True, index=i, kind=dec[i], cross_kind=cross[i])
            for i in range(cfg.n_decoder_layers)
        )
        self.enc_norm = make_norm(cfg) if cfg.pre_ln else nn.Identity()
        self.dec_norm = make_norm(cfg) if cfg.pre_ln else nn.Identity()
        self.out_proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.out_proj.weight = self.tgt_emb.weight

    def new_cache(self) -> KVCache:
        return KVCache.empty(self.cfg.n_decoder_layers)

    def encode(self, src: Tensor, src_mask: Tensor | None = None, src_pos: Tensor | None = None) -> Tensor:
        """``src`` (B, S) -> memory (B, S, D)."""
        centred = src_pos is None  # 0 … S-1 in one forward: may move their origin
        pe = self.layer_pes.place("encoder")
        pos = self._new_positions(pe, src, src_pos, None, centred=centred)  # (B|1, S)
        ctxs = self._contexts("encoder", pos, pos, False, src_mask, from_zero=centred, centred=centred)
        x = self._embed(self.src_emb, pe, src, pos)
        for block, ctx in zip(self.encoder, ctxs, strict=True):
            x = block(x, ctx)
        return self.enc_norm(x)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_mask: Tensor | None = None,
        *,
        tgt_pos: Tensor | None = None,
        src_pos: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """``tgt`` (B, T) attending to ``memory`` (B, S, D) -> logits (B, T, V)."""
        from_zero = tgt_pos is None and cache is None  # 0 … T-1 in one forward: may move their origin
        pe = self.layer_pes.place("decoder")
        pos = self._new_positions(pe, tgt, tgt_pos, cache, centred=from_zero)  # (B|1, T)
        k_pos, padding = pos, tgt_mask  # (B|1, T_past + T), (B, T_past + T) | None
        replay = cache.replay(pe, tgt, pos, tgt_mask) if cache is not None else None
        if replay is not None:  # the grown length changed the PE's rotary tables: run every token again
            every, every_pos, every_pad = replay
            return self.decode(
                every, memory, src_mask, tgt_pos=every_pos, src_pos=src_pos, tgt_mask=every_pad, cache=cache
            )[:, -tgt.shape[1] :]
        past = cache.length if cache is not None else None
        if cache is not None:
            k_pos, padding = cache.extend(tgt, pos, tgt_mask)
        self_ctxs = self._contexts(
            "decoder", pos, k_pos, True, padding, from_zero=from_zero, past=past, centred=from_zero
        )
        s_pos = as_positions(src_pos) if src_pos is not None else default_positions(memory[..., 0])
        cross_from_zero = from_zero and src_pos is None
        cross_ctxs = self._contexts("cross", pos, s_pos, False, src_mask, from_zero=cross_from_zero)
        x = self._embed(self.tgt_emb, pe, tgt, pos)
        for i, block in enumerate(self.decoder):
            x = block(
                x,
                self_ctxs[i],
                memory=memory,
                cross_ctx=cross_ctxs[i],
                cache=cache.layers[i] if cache is not None else None,
            )
        return self.out_proj(self.dec_norm(x))  # (B, T, V)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        *,
        src_pos: Tensor | None = None,
        tgt_pos: Tensor | None = None,
    ) -> Tensor:
        """Teacher-forced logits (B, T, V); ``src_pos`` (B|1, S) / ``tgt_pos`` (B|1, T) default to 0, 1, …"""
        memory = self.encode(src, src_mask, src_pos)
        return self.decode(tgt, memory, src_mask, tgt_pos=tgt_pos, src_pos=src_pos, tgt_mask=tgt_mask)


def build_model(cfg: ModelConfig) -> DecoderOnlyTransformer | EncoderDecoderTransformer:
    """Build the model selected by ``cfg.kind`` (refused first when its weights cannot fit in the host's
    memory: :func:`posformer.model.size.check_model_fits`)."""
    check_model_fits(cfg)
    return DecoderOnlyTransformer(cfg) if cfg.kind == "decoder" else EncoderDecoderTransformer(cfg)
