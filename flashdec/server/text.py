"""Generated token ids to text, as they stream: incremental detokenization and stop strings.

A token's text can depend on its neighbours (a leading space, a character split over several
byte-level tokens), so each new piece is the difference of two decodes over a short window of
recent ids; a window whose text ends in U+FFFD (an incomplete UTF-8 sequence) waits for the next
token. Stop strings are matched on the decoded text: the output ends just before the first
match, and text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence

# prompt ids that seed the window, so the first generated token decodes in context
_CONTEXT_TOKENS = 5


class IncrementalText:
    """The text of one request's output, token by token.

    Args:
        tokenizer: a transformers tokenizer (``decode(ids, skip_special_tokens=True)``).
        prompt_ids: the request's prompt (its last few ids give the first token its context).
        stop: strings that end the output (excluded from it).
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this are already text
        self.text = ""  # the output so far (without a matched stop string)
        self._sent = 0  # characters of ``text`` handed out by ``add``/``finish``
        self.num_tokens = 0  # tokens that made up ``text`` (counted up to a stop match)
        self.stopped = False  # a stop string matched: the output is complete

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new tokens; return the text that is now safe to send (may be empty). Tokens
        after a stop match are ignored."""
        for token in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            self._ids.append(int(token))
            before = self._decode(self._ids[self._prefix : self._read])
            after = self._decode(self._ids[self._prefix :])
            if len(after) <= len(before) or after.endswith("\ufffd"):
                continue  # nothing new yet, or a character still incomplete
            start = len(self.text)
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
            self._match_stop(start)
        return self._take(len(self.text) if self.stopped else len(self.text) - self._held())

    def finish(self) -> str:
        """The output ended: the held-back rest."""
        return self._take(len(self.text))

    def _match_stop(self, start: int) -> None:
        if not self.stop:
            return
        window = max(0, start - self._longest_stop + 1)  # a match may begin in earlier text
        found = [p for p in (self.text.find(s, window) for s in self.stop) if p >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def _held(self) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        for n in range(min(self._longest_stop - 1, len(self.text) - self._sent), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _take(self, end: int) -> str:
        piece = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return piece
