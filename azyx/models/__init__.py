"""Models written with azyx's layers, loadable from Hugging Face checkpoints (safetensors + config.json).

- `azyx.models.gpt2`: GPT-2 (`GPT2.from_pretrained`), its slot-pooled KV cache and the generation engine with
  continuous batching (`Engine`), and `load_tokenizer` for its byte-level BPE.
- `azyx.models.text`: `TextStream`, a token stream as text: incremental detokenization handing out whole
  characters only, stop strings matched on the text across token boundaries.
"""

from azyx.models.gpt2 import (
    GPT2,
    Engine,
    GPT2Config,
    KVCache,
    NoFreeSlotError,
    SamplingParams,
    Sequence,
    TokenStream,
    load_tokenizer,
)
from azyx.models.text import TextStream

__all__ = ["GPT2", "Engine", "GPT2Config", "KVCache", "NoFreeSlotError", "SamplingParams", "Sequence",
           "TextStream", "TokenStream", "load_tokenizer"]
