"""The two Transformer models: decoder-only and encoder-decoder, built from shared blocks.

Positions are an explicit tensor (B|1, T) passed down to every attention layer through an
:class:`~posformer.model.attention.AttentionContext`; the models call PE hooks and never test a
PE's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posformer.errors import ConfigError
from posformer.model.attention import AttentionContext, LayerCache, MultiHeadAttention
from posformer.model.config import ModelConfig
from posformer.pe import build_encoding, get_encoding_class
from posformer.pe.base import PositionalEncoding, as_positions


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str, bias: bool = True):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff, bias=bias), nn.Linear(d_ff, d_model, bias=bias)
        self.act = F.gelu if activation == "gelu" else F.relu
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, D)
        return self.fc2(self.dropout(self.act(self.fc1(x))))


class Block(nn.Module):
    """Self-attention [+ cross-attention] + feed-forward, each a residual sub-layer.

    Post-LN (the paper): ``x = LN(x + Dropout(Sublayer(x)))``; pre-LN: ``x = x + Dropout(Sublayer(LN(x)))``.
    """

    def __init__(self, cfg: ModelConfig, *, cross: bool, index: int):
        super().__init__()
        d = cfg.d_model
        self.index, self.pre_ln = index, cfg.pre_ln
        self.self_attn = MultiHeadAttention(d, cfg.n_heads, cfg.attn_dropout, bias=cfg.bias)
        self.norm1 = nn.LayerNorm(d)
        self.cross_attn = (
            MultiHeadAttention(d, cfg.n_heads, cfg.attn_dropout, cross=True, bias=cfg.bias) if cross else None
        )
        self.norm2 = nn.LayerNorm(d) if cross else None
        self.ffn = FeedForward(d, cfg.ffn_dim, cfg.dropout, cfg.activation, cfg.bias)
        self.norm3 = nn.LayerNorm(d)
        self.dropout = nn.Dropout(cfg.dropout)

    def _sublayer(self, x: Tensor, norm: nn.LayerNorm, fn) -> Tensor:
        if self.pre_ln:
            return x + self.dropout(fn(norm(x)))
        return norm(x + self.dropout(fn(x)))

    def forward(
        self,
        x: Tensor,
        self_ctx: AttentionContext,
        *,
        memory: Tensor | None = None,
        cross_ctx: AttentionContext | None = None,
        cache: tuple[LayerCache, LayerCache] | None = None,
    ) -> Tensor:
        """``x`` (B, T, D) -> (B, T, D)."""
        sc, cc = cache if cache is not None else (None, None)
        x = self._sublayer(x, self.norm1, lambda h: self.self_attn(h, self_ctx, layer=self.index, cache=sc))
        if self.cross_attn is not None:
            x = self._sublayer(
                x,
                self.norm2,
                lambda h: self.cross_attn(h, cross_ctx, layer=self.index, memory=memory, cache=cc),
            )
        return self._sublayer(x, self.norm3, self.ffn)


@dataclass
class KVCache:
    """Incremental-decoding state: per layer (self, cross) caches, the positions and padding seen so far."""

    layers: list[tuple[LayerCache, LayerCache]]
    positions: Tensor | None = None  # (B|1, T_past)
    padding: Tensor | None = None  # (B, T_past) bool, True = real
    extra: dict = field(default_factory=dict)

    @classmethod
    def empty(cls, n_layers: int) -> KVCache:
        return cls([(LayerCache(), LayerCache()) for _ in range(n_layers)])

    @property
    def length(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def reorder(self, index: Tensor) -> None:
        """Select/reorder batch rows (beam search): ``index`` (B',) of row indices."""

        def pick(t: Tensor | None) -> Tensor | None:
            if t is None or t.shape[0] == 1:
                return t
            return t.index_select(0, index)

        for sc, cc in self.layers:
            sc.reorder(index)
            cc.reorder(index)
        self.positions, self.padding = pick(self.positions), pick(self.padding)
        for key, value in self.extra.items():
            self.extra[key] = pick(value)


def _pe_uses(pe_cls: type[PositionalEncoding], where: str, cfg: ModelConfig) -> bool:
    return bool(cfg.pe_apply.get(where, where != "cross")) and bool(pe_cls.capabilities.hooks)


class _Base(nn.Module):
    """Shared pieces: PE construction, embeddings, init."""

    cfg: ModelConfig

    def _build_pe(self, where: str, *, causal: bool, n_layers: int) -> PositionalEncoding | None:
        cfg = self.cfg
        pe_cls = get_encoding_class(cfg.pe)
        if not _pe_uses(pe_cls, where, cfg):
            return None
        return build_encoding(
            cfg.pe,
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            causal=causal,
            n_layers=n_layers,
            **cfg.pe_options,
        )

    def _check_pe_apply(self, places: tuple[str, ...]) -> None:
        cfg = self.cfg
        pe_cls = get_encoding_class(cfg.pe)
        if not pe_cls.capabilities.hooks:
            return
        if "embed" in pe_cls.capabilities.hooks and cfg.pe_apply.get("cross", False):
            raise ConfigError(
                f"model.pe_apply.cross=true has no effect for pe={cfg.pe!r}: it is added to the embeddings, "
                "not applied inside attention. Set model.pe_apply.cross=false."
            )
        if not any(cfg.pe_apply.get(p, p != "cross") for p in places):
            raise ConfigError(
                f"pe={cfg.pe!r} is applied nowhere: model.pe_apply={dict(cfg.pe_apply)} disables "
                f"{', '.join(places)}. Enable one of them, or use pe=nope for no positions."
            )

    def _embed(
        self, emb: nn.Embedding, pe: PositionalEncoding | None, ids: Tensor, positions: Tensor
    ) -> Tensor:
        x = emb(ids)  # (B, T, D)
        if self.cfg.scale_embedding:
            x = x * math.sqrt(self.cfg.d_model)
        if pe is not None and "embed" in pe.caps.hooks:
            x = pe.embed(x, positions)
        return self.emb_dropout(x)

    def _init_weights(self) -> None:
        d = self.cfg.d_model
        for name, p in self.named_parameters():
            if ".pe" in name or name.startswith("pe"):
                continue  # PEs own their initialisation
            if p.dim() == 2 and "emb" in name.split(".")[0]:
                nn.init.normal_(p, std=d**-0.5 if self.cfg.scale_embedding else 0.02)
            elif p.dim() == 2:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias") and "norm" not in name:
                nn.init.zeros_(p)
        for emb in self.modules():
            if isinstance(emb, nn.Embedding) and emb.padding_idx is not None:
                with torch.no_grad():
                    emb.weight[emb.padding_idx].zero_()

    def _context(self, pe, q_pos, k_pos, causal, padding) -> AttentionContext:
        attn_pe = pe if pe is not None and pe.caps.in_attention else None
        if attn_pe is not None:
            attn_pe.check_positions(k_pos)
        return AttentionContext(
            attn_pe,
            q_pos,
            k_pos,
            causal=causal,
            key_padding_mask=padding,
            chunk_bytes=self.cfg.attention_chunk_mb * 2**20,
        )

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for m in self.modules():
                if isinstance(m, nn.Embedding):
                    params.pop(id(m.weight), None)
        return sum(p.numel() for p in params.values())


def _append_positions(past: Tensor, new: Tensor) -> Tensor:
    """Cached positions (B|1, T_past) followed by new ones (B|1, T), broadcasting a batch of 1."""
    if past.shape[0] != new.shape[0]:
        batch = max(past.shape[0], new.shape[0])
        past, new = past.expand(batch, -1), new.expand(batch, -1)
    return torch.cat((past, new), 1)


def default_positions(ids: Tensor, offset: int = 0) -> Tensor:
    """Contiguous positions offset..offset+T-1 as a (1, T) int64 tensor."""
    return torch.arange(offset, offset + ids.shape[1], device=ids.device).unsqueeze(0)


def continued_positions(ids: Tensor, cache: KVCache | None) -> Tensor:
    """Default positions of new tokens ``ids`` (B, T): ``0 … T-1`` without a cache, else continuing
    from the last cached position of each row (``last + 1 …``; equals ``cache.length …`` for
    ordinary positions, and keeps an explicit offset going): (B|1, T)."""
    if cache is None or cache.positions is None:
        return default_positions(ids)
    last = cache.positions[:, -1:]  # (B|1, 1)
    return last + 1 + torch.arange(ids.shape[1], device=ids.device, dtype=last.dtype)


class DecoderOnlyTransformer(_Base):
    """GPT-style causal language model.

    ``forward(input_ids (B, T), positions (B|1, T) | None, attention_mask (B, T) | None, cache)``
    ``-> logits (B, T, V)``
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.kind != "decoder":
            raise ConfigError(f"DecoderOnlyTransformer needs model.kind='decoder', got {cfg.kind!r}.")
        self.cfg = cfg
        self._check_pe_apply(("decoder",))
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pe = self._build_pe("decoder", causal=True, n_layers=cfg.n_layers)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, cross=False, index=i) for i in range(cfg.n_layers))
        self.norm_f = nn.LayerNorm(cfg.d_model) if cfg.pre_ln else nn.Identity()
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
    ) -> Tensor:
        offset = cache.length if cache is not None else 0
        pos = as_positions(positions) if positions is not None else continued_positions(input_ids, cache)
        if self.pe is not None:
            self.pe.check_positions(pos)
        k_pos, padding = pos, attention_mask
        if cache is not None:
            if cache.positions is not None:
                k_pos = _append_positions(cache.positions, pos)
            if attention_mask is not None or cache.padding is not None:
                past = (
                    cache.padding
                    if cache.padding is not None
                    else torch.ones(input_ids.shape[0], offset, dtype=torch.bool, device=input_ids.device)
                )
                new = (
                    attention_mask
                    if attention_mask is not None
                    else torch.ones_like(input_ids, dtype=torch.bool)
                )
                padding = torch.cat((past, new), 1)
            cache.positions, cache.padding = k_pos, padding
        ctx = self._context(self.pe, pos, k_pos, True, padding)
        x = self._embed(self.tok_emb, self.pe, input_ids, pos)  # (B, T, D)
        for i, block in enumerate(self.blocks):
            x = block(x, ctx, cache=cache.layers[i] if cache is not None else None)
        return self.lm_head(self.norm_f(x))  # (B, T, V)


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
        self._check_pe_apply(("encoder", "decoder", "cross"))
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
        self.pe_enc = self._build_pe("encoder", causal=False, n_layers=cfg.n_encoder_layers)
        self.pe_dec = self._build_pe("decoder", causal=True, n_layers=cfg.n_decoder_layers)
        pe_cls = get_encoding_class(cfg.pe)
        self.pe_cross = (
            self._build_pe("cross", causal=False, n_layers=cfg.n_decoder_layers)
            if cfg.pe_apply.get("cross", False) and pe_cls.capabilities.in_attention
            else None
        )
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(Block(cfg, cross=False, index=i) for i in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(Block(cfg, cross=True, index=i) for i in range(cfg.n_decoder_layers))
        self.enc_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_ln else nn.Identity()
        self.dec_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_ln else nn.Identity()
        self.out_proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.out_proj.weight = self.tgt_emb.weight

    def new_cache(self) -> KVCache:
        return KVCache.empty(self.cfg.n_decoder_layers)

    def encode(self, src: Tensor, src_mask: Tensor | None = None, src_pos: Tensor | None = None) -> Tensor:
        """``src`` (B, S) -> memory (B, S, D)."""
        pos = as_positions(src_pos) if src_pos is not None else default_positions(src)
        if self.pe_enc is not None:
            self.pe_enc.check_positions(pos)
        ctx = self._context(self.pe_enc, pos, pos, False, src_mask)
        x = self._embed(self.src_emb, self.pe_enc, src, pos)
        for block in self.encoder:
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
        offset = cache.length if cache is not None else 0
        pos = as_positions(tgt_pos) if tgt_pos is not None else continued_positions(tgt, cache)
        if self.pe_dec is not None:
            self.pe_dec.check_positions(pos)
        k_pos, padding = pos, tgt_mask
        if cache is not None:
            if cache.positions is not None:
                k_pos = _append_positions(cache.positions, pos)
            if tgt_mask is not None or cache.padding is not None:
                past = (
                    cache.padding
                    if cache.padding is not None
                    else torch.ones(tgt.shape[0], offset, dtype=torch.bool, device=tgt.device)
                )
                new = tgt_mask if tgt_mask is not None else torch.ones_like(tgt, dtype=torch.bool)
                padding = torch.cat((past, new), 1)
            cache.positions, cache.padding = k_pos, padding
        self_ctx = self._context(self.pe_dec, pos, k_pos, True, padding)
        s_pos = as_positions(src_pos) if src_pos is not None else default_positions(memory[..., 0])
        cross_ctx = self._context(self.pe_cross, pos, s_pos, False, src_mask)
        x = self._embed(self.tgt_emb, self.pe_dec, tgt, pos)
        for i, block in enumerate(self.decoder):
            x = block(
                x,
                self_ctx,
                memory=memory,
                cross_ctx=cross_ctx,
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
    """Build the model selected by ``cfg.kind``."""
    return DecoderOnlyTransformer(cfg) if cfg.kind == "decoder" else EncoderDecoderTransformer(cfg)
