"""One request's text as its tokens arrive, and the stop strings looked for in it.

Decoding a token alone gives wrong text: a character split over byte tokens, or a leading space
that depends on the token before. So each new token is decoded with the few tokens before it,
and text is taken only once it no longer ends in an unfinished character (the prefix and read
offsets of vLLM's and TGI's incremental detokenizers). The text is that of the generated tokens
alone, as ``Tokenizer.decode`` gives it. A stop string may span tokens, so the text that could
still be the start of one is held back from streaming until it is decided.
"""

from __future__ import annotations

from collections.abc import Sequence

from neuron_buckets.engine.tokenizer import Tokenizer

UNFINISHED = "\ufffd"  # what a decoder gives for the first bytes of a character still to come


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.prefix = self.read = 0  # ids[prefix:read] were decoded for context; ids[read:] are not yet text
        self.hold = max(map(len, self.stop), default=1) - 1
        self.stopped_by: str | None = None

    def push(self, token: int, search: bool = True) -> str | None:
        """Add a generated token; the stop string the text now contains, if any (the text is cut
        just before it). ``search=False`` adds its text unsearched: a token within ``min_tokens``."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        now = self.tokenizer.decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith(UNFINISHED):
            self._extend(now[len(before) :], search)
            self.prefix, self.read = self.read, len(self.ids)
        return self.stopped_by

    def flush(self, search: bool = True) -> None:
        """The request ended: the text still held as unfinished is final as it is."""
        if self.read < len(self.ids) and self.stopped_by is None:
            before = self.tokenizer.decode(self.ids[self.prefix : self.read])
            self._extend(self.tokenizer.decode(self.ids[self.prefix :])[len(before) :], search)
            self.read = len(self.ids)

    def visible(self, finished: bool) -> str:
        """The text a client may see: all of it once finished, else all but what may begin a stop
        string."""
        return self.text if finished or not self.hold else self.text[: max(len(self.text) - self.hold, 0)]

    def _extend(self, new: str, search: bool = True) -> None:
        start = max(len(self.text) - self.hold, 0)  # a stop string may begin in earlier text
        self.text += new
        if search and (hit := self._search(self.text[start:])):
            at, self.stopped_by = hit
            self.text = self.text[: start + at]

    def _search(self, window: str) -> tuple[int, str] | None:
        """The first stop string in ``window``, the new text and the ``hold`` characters before it:
        what a token costs grows with the stop strings, never with the text before them."""
        return min(((i, s) for s in self.stop if (i := window.find(s)) >= 0), default=None)
