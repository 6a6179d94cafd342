"""What the engine hands back after a step: per request, only what is new since its last
output (token ids, text, logprob entries, the finish reason), so that a step costs the same
however much a request has generated. Each position's logprob entry is built once, when its
logprobs arrive; each token id's text is decoded once per engine. Callers that want whole
outputs fold the deltas with outputs.OutputAccumulator.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq

from cpud.engine.detokenizer import Decoder
from cpud.engine.outputs import CompletionOutput, Logprob, RequestOutput
from cpud.engine.request import Request
from cpud.engine.sequence import LogprobEntry, Sequence
from cpud.protocol.step import PromptLogprobs, SampledToken


class TokenNames:
    """Each token id's own text (special tokens spelled out), decoded once: at most one
    entry per vocabulary id."""

    def __init__(self, decoder: Decoder):
        self._decoder = decoder
        self._names: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        name = self._names.get(token)
        if name is None:
            name = self._decoder.decode([token], skip_special_tokens=False)
            self._names[token] = name
        return name


def logprob_entry(
    names: TokenNames,
    token: int,
    logprob: float,
    rank: int,
    top_ids: Seq[int],
    top_values: Seq[float],
) -> LogprobEntry:
    """The position's token first, then its alternatives by rank, as vLLM orders them."""
    entry = {token: Logprob(logprob, rank, names(token))}
    for place, (other, value) in enumerate(zip(top_ids, top_values), start=1):
        if other not in entry:
            entry[other] = Logprob(value, place, names(other))
    return entry


class OutputBuilder:
    def __init__(self, decoder: Decoder):
        self.names = TokenNames(decoder)

    def add_sampled(self, seq: Sequence, sampled: SampledToken) -> None:
        """Keep the logprobs that came with a sampled token (appended after the token) until
        the next output hands them out."""
        if sampled.logprob is None:
            return
        seq.cumulative_logprob += sampled.logprob
        seq.new_logprobs.append(
            logprob_entry(
                self.names,
                sampled.token_id,
                sampled.logprob,
                sampled.rank or 0,
                sampled.top_token_ids,
                sampled.top_logprobs,
            )
        )

    def add_prompt(self, seq: Sequence, scored: PromptLogprobs) -> None:
        add_prompt_logprobs(seq, scored, self.names)

    def output(self, request: Request) -> RequestOutput | None:
        """What is new in the request since its last output: per choice with news, its new
        token ids, text and logprob entries, and its finish reason when it has just finished.
        None when no choice has news."""
        outputs = [delta for seq in request.seqs if (delta := completion_delta(seq)) is not None]
        if not outputs:
            return None
        scorer = request.seqs[0]
        if scorer.scores_prompt and request.prompt_logprobs is None:
            request.prompt_logprobs = [None, *scorer.prompt_logprobs]
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            outputs,
            request.finished,
            prompt_logprobs=request.prompt_logprobs,
            num_cached_tokens=scorer.num_cached_tokens,
        )


def completion_delta(seq: Sequence) -> CompletionOutput | None:
    """One choice's news (marked as handed out), or None when it has none."""
    if seq.emitted_finish:
        return None
    first = seq.num_prompt_tokens + seq.num_emitted_tokens
    token_ids = seq.token_ids[first:]
    finished = seq.finished
    # While running, hold back what could still turn out to be a stop string.
    text = seq.detokenizer.take(finished)
    if not token_ids and not text and not finished:
        return None
    seq.num_emitted_tokens += len(token_ids)
    seq.emitted_finish = finished
    wants_logprobs = seq.params.logprobs is not None
    logprobs = None
    if wants_logprobs:
        logprobs, seq.new_logprobs = seq.new_logprobs, []
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )


def add_prompt_logprobs(seq: Sequence, scored: PromptLogprobs, names: TokenNames) -> None:
    """Append a step's scored prompt positions (they continue where the last step ended)."""
    values, tops = array("f"), array("f")
    values.frombytes(scored.logprobs)
    tops.frombytes(scored.top_logprobs)
    count = len(values)
    done = len(seq.prompt_logprobs)
    targets = seq.prompt_token_ids[done + 1 : done + 1 + count]
    ids = scored.top_token_ids
    if len(targets) != count or len(scored.ranks) != count or len(tops) != len(ids):
        raise ValueError(f"{count} prompt logprobs do not fit the prompt's unscored positions")
    width = len(ids) // count if count else 0
    for row, token in enumerate(targets):
        span = slice(row * width, (row + 1) * width)
        seq.prompt_logprobs.append(
            logprob_entry(names, token, values[row], scored.ranks[row], ids[span], tops[span])
        )
