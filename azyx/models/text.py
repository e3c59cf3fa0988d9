"""Token streams as text: incremental detokenization that only ever hands out whole characters, and stop strings
matched on the decoded text across token boundaries (never handed out).

    text = TextStream(tokenizer, stop=["\\n\\n", "END"])
    async for token in engine.generate(ids, ...):
        piece = text.push(token)        # "" while a character or a possible stop string is incomplete
        ...send piece...
        if text.stopped is not None:    # a stop string completed: end the stream (its text was never handed out)
            stream.cancel("stop")
            break
    rest = text.flush()                 # at the end: what was held back (a stop string's unfinished start)

- A byte-level BPE (GPT-2's) splits a multi-byte character across tokens: decoding one token alone gives U+FFFD.
  `TextStream` decodes a short window of recent tokens and hands out only the text past what it handed out before,
  once the window's text no longer ends with an incomplete character (U+FFFD at its end; after `MAX_HELD` tokens
  without a whole character the replacement character is handed out, as `decode` of the whole stream would). The
  concatenation of every `push` and the `flush` is `tokenizer.decode(all tokens)` (cut before a stop string).
- Stop strings: the text that could still be the start of a stop string is held back; a completed stop string ends
  the stream with the text before it (`stopped` names it), whichever tokens its characters came in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from azyx.errors import ArgumentError

REPLACEMENT = "\ufffd"
MAX_HELD = 4  # tokens held back for an incomplete character (a UTF-8 character has at most 4 bytes)
CONTEXT = 4  # tokens decoded before the new ones (a tokenizer may decode a token differently at a sequence's start)


class TextStream:
    """The text of a token stream, piece by piece: `push(token)` returns the new whole text (possibly ""), `flush()`
    what is left at the end; `stopped` is the stop string that ended the text (None: none yet); `text` is all that
    was handed out. `tokenizer` needs `decode(ids) -> str` (a `tokenizers.Tokenizer`, or `load_tokenizer`'s)."""

    def __init__(self, tokenizer: Any, stop: Iterable[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in dict.fromkeys(stop)]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ArgumentError(f"stop strings must be non-empty strings, got {self.stop!r}")
        self.stopped: str | None = None
        self.text = ""  # handed out so far
        self._tokens: list[int] = []  # the decode window: CONTEXT tokens already handed out, then the unread ones
        self._read = 0  # index in _tokens of the first token whose text is not handed out
        self._held = ""  # decoded text held back: it could be the start of a stop string

    def push(self, token: int) -> str:
        """The text `token` completes (whole characters, no stop string, nothing after one); "" once stopped."""
        if self.stopped is not None:
            return ""
        self._tokens.append(int(token))
        new = self._decode(final=False)
        return self._release(new) if new else ""

    def flush(self) -> str:
        """At the end of the stream: the text still held back (an incomplete character as U+FFFD, the unfinished
        start of a stop string as text)."""
        if self.stopped is not None:
            return ""
        new = self._decode(final=True)
        out = self._release(new) if new else ""
        out += self._held
        self.text += self._held
        self._held = ""
        return out

    def _decode(self, final: bool) -> str:
        if self._read == len(self._tokens):
            return ""
        before = self.tokenizer.decode(self._tokens[: self._read])
        whole = self.tokenizer.decode(self._tokens)
        if not final and whole.endswith(REPLACEMENT) and len(self._tokens) - self._read < MAX_HELD:
            return ""  # an incomplete character: wait for the token that completes it
        if not whole.startswith(before):  # (a tokenizer that rewrites earlier text given more: hand out the change)
            before = before[: next((i for i, (a, b) in enumerate(zip(before, whole)) if a != b), len(before))]
        new = whole[len(before):]
        self._tokens = self._tokens[-CONTEXT:]
        self._read = len(self._tokens)
        return new

    def _release(self, new: str) -> str:
        """`new` text after what is held: the part that can no longer become a stop string is handed out; a stop
        string that completes ends the text before it."""
        text = self._held + new
        if self.stop:
            hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
            if hits:
                i, s = min(hits)
                self.stopped, self._held = s, ""
                self.text += text[:i]
                return text[:i]
            keep = max((k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                        if text.endswith(s[:k])), default=0)
        else:
            keep = 0
        out, self._held = text[: len(text) - keep], text[len(text) - keep:]
        self.text += out
        return out
