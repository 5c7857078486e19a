"""Episodes in tokens: what the generation engine sees of an environment.

    codec = TurnCodec(template, tokenizer, stop_ids=text_stop_ids(end_ids, stop_token_ids), parser=parser)
    s = Session(env.start(record), codec)
    s.prompt_ids                                   # the first prefill (tools rendered in when the episode has some)
    out = s.end_turn(turn_ids, "call")             # Outcome: observation_ids to prefill, or done; reward
    s.response_ids(), s.response_mask()            # everything after the prompt; 1 = sampled, 0 = observation

A turn's ids (as sampled, ending at eos, a stop id, the parser's call close, or cut by the token budget)
become a Turn: cut at the first eos/stop id and decoded exactly as the reward stage does
(data/rewards.make_samples), so an environment's reward sees the same Sample. The observation after a
turn is the chat template's own rendering of the episode's new messages: the conversation is rendered
with the turn replaced by a sentinel, and the text after the sentinel (the end of the assistant
message, the tool or user messages, the next assistant header) is tokenized. When the policy already
sampled the end-of-turn token the template writes there (its eos), that token is not repeated. The
observation ids are appended to the sequence and prefilled, never sampled.

Where a turn ends: the engine stops a sequence at its eos and stop ids as today, and (with
env.stop_at_call) at `stop_strings` (the parser's call close, e.g. "</tool_call>"), or
`stop_token_ids` when that close is a single token of the tokenizer (Qwen2.5 and Qwen3 have one).

Called by: env/runner.py; tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from rpeg_jax.data.chat import ChatTemplate
from rpeg_jax.data.tokenizer import Tokenizer, completion_ids
from rpeg_jax.env.base import Episode, Turn, TurnEnd
from rpeg_jax.env.parsers import ToolParser

SENTINEL = "\u2063rpeg-turn-7f3a\u2063"  # stands for the turn while the template renders what follows it


class SessionError(RuntimeError):
    """The template cannot render an observation (e.g. it drops or repeats the assistant's content)."""


@dataclass(frozen=True)
class Outcome:
    """What the engine does after a turn: prefill observation_ids and resume sampling, or finish."""

    observation_ids: tuple[int, ...]  # to append and prefill (loss-masked); () when done
    done: bool
    reward: float  # this turn's reward
    info: dict[str, Any] = field(default_factory=dict)


class TurnCodec:
    """Token ids <-> turns and observations, for one chat template and tokenizer (thread-safe: no state)."""

    def __init__(
        self,
        template: ChatTemplate | None,
        tokenizer: Tokenizer,
        stop_ids: Sequence[int],
        parser: ToolParser | None = None,
        stop_at_call: bool = True,
    ):
        self.template, self.tokenizer, self.parser = template, tokenizer, parser
        self.stop_ids = tuple(int(i) for i in stop_ids)  # where a turn's text ends (data/rewards.text_stop_ids)
        self.stop_at_call = stop_at_call and parser is not None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end a policy turn besides eos and stop ids: the parser's call close."""
        return (self.parser.call_end,) if self.stop_at_call else ()

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The call close as one token id, when the tokenizer has it as one (else: use stop_strings)."""
        if not self.stop_at_call:
            return ()
        ids = self.tokenizer.encode(self.parser.call_end)
        return (ids[0],) if len(ids) == 1 else ()

    def check_tokens(self) -> None:
        """The parser's call tags survive decoding (a tokenizer that drops them as special tokens would
        hide every call from the parser)."""
        if self.parser is None:
            return
        for tag in (self.parser.call_start, self.parser.call_end):
            back = self.tokenizer.decode(self.tokenizer.encode(f"x{tag}x"))
            if tag not in back:
                raise SessionError(f"the tokenizer does not decode {tag!r} back (got {back!r}): tool calls are lost")

    def turn(self, ids: Sequence[int], end: TurnEnd) -> Turn:
        cut = completion_ids(ids, self.tokenizer.eos_id, self.stop_ids)
        return Turn(self.tokenizer.decode(cut), tuple(cut), end)

    def prompt_ids(self, episode: Episode) -> list[int]:
        """The first prefill: the record's own prompt_tokens when the episode shows no tools (the data
        pipeline rendered them), else its messages rendered with the tool schemas."""
        text = self.prompt_text(episode)
        return list(episode.record["prompt_tokens"]) if text is None else self.tokenizer.encode(text)

    def prompt_text(self, episode: Episode) -> str | None:
        """The first prefill's text when this codec renders it (an episode with tools), else None (the
        record's own prompt, as the data pipeline rendered it)."""
        if episode.tools is None and "prompt_tokens" in episode.record:
            return None
        if self.template is None:
            raise SessionError("an episode with tools needs a chat template (data.chat_template)")
        return self.template.render(episode.messages, add_generation_prompt=True, tools=episode.tools)

    def observation_ids(self, episode: Episode, n_observations: int, turn_ids: Sequence[int]) -> list[int]:
        """The tokens after the turn: the template's rendering of the episode's last n_observations
        messages (and of the end of the turn before them, and of the next assistant header)."""
        if self.template is None:
            raise SessionError("observations are rendered by the chat template; the run has none")
        msgs = episode.messages
        k = len(msgs) - n_observations - 1  # the assistant turn's message
        if k < 0 or msgs[k].get("role") != "assistant":
            raise SessionError("the turn's assistant message is not where the observations follow it")
        history = [*msgs[:k], {**msgs[k], "content": SENTINEL}, *msgs[k + 1 :]]
        text = self.template.render(history, add_generation_prompt=True, tools=episode.tools)
        if text.count(SENTINEL) != 1:
            raise SessionError(f"the chat template rendered the assistant's content {text.count(SENTINEL)} times")
        ids = self.tokenizer.encode(text[text.index(SENTINEL) + len(SENTINEL) :])
        ends = {self.tokenizer.eos_id, *self.stop_ids}
        if turn_ids and ids and int(turn_ids[-1]) == ids[0] and ids[0] in ends:
            ids = ids[1:]  # the policy sampled the end-of-turn token already
        return ids


class Session:
    """One sequence's episode in tokens (module doc). Not thread-safe: one turn at a time."""

    def __init__(self, episode: Episode, codec: TurnCodec):
        self.episode, self.codec = episode, codec
        self.prompt_text = codec.prompt_text(episode)  # None: the record's own (pipeline-rendered) prompt
        self.prompt_ids = codec.prompt_ids(episode)
        self.pieces: list[tuple[bool, list[int]]] = []  # (sampled?, ids) after the prompt, in order

    @property
    def done(self) -> bool:
        return self.episode.done

    def end_turn(self, turn_ids: Sequence[int], end: TurnEnd) -> Outcome:
        """The policy's turn (its sampled ids) ended: step the episode; what the engine does next."""
        turn_ids = [int(i) for i in turn_ids]
        self.pieces.append((True, turn_ids))
        res = self.episode.step(self.codec.turn(turn_ids, end))
        if res.done:
            self.episode.close()
            return Outcome((), True, res.reward, res.info)
        obs = self.codec.observation_ids(self.episode, len(res.observations), turn_ids)
        self.pieces.append((False, obs))
        return Outcome(tuple(obs), False, res.reward, res.info)

    def response_ids(self) -> list[int]:
        return [i for _, ids in self.pieces for i in ids]

    def response_mask(self) -> list[int]:
        """1 for each sampled token (trained on), 0 for each observation token."""
        return [int(sampled) for sampled, ids in self.pieces for _ in ids]

    @property
    def stats(self):
        return self.episode.stats

    @property
    def rewards(self) -> list[float]:
        return self.episode.rewards

    @property
    def total_reward(self) -> float:
        return self.episode.total_reward
