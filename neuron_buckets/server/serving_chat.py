"""``POST /v1/chat/completions`` (vLLM's ``OpenAIServingChat``): messages rendered with the
artifact's chat template, the reply's ``<tool_call>`` blocks parsed into ``tool_calls`` when the
request has tools (``hermes_tool_parser.py``).

A stream opens each choice with the assistant's role, as OpenAI's does. A reply that may hold
tool calls streams as one chunk at its end: a call is only known whole.
"""

from __future__ import annotations

from neuron_buckets.engine.logprobs import TokenLogprob
from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.tokenizer import Tokenizer
from neuron_buckets.server import hermes_tool_parser
from neuron_buckets.server.chat_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ToolCallDelta,
)
from neuron_buckets.server.openai_protocol import Usage
from neuron_buckets.server.serving import Endpoint, new_logprobs
from neuron_buckets.utils.errors import UserError


class ChatEndpoint(Endpoint[ChatCompletionRequest]):
    id_prefix = "chatcmpl"

    def prompt_ids(self, tokenizer: Tokenizer | None) -> list[int]:
        if tokenizer is None:
            raise UserError("this artifact has no tokenizer, so it cannot render chat messages")
        body = self.body
        messages = [m.as_template_input() for m in body.messages]
        return tokenizer.apply_chat_template(messages, body.add_special_tokens, body.template_tools())

    def logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        return ChatLogprobs.of(entries, self.server.token_text) if self.body.logprobs else None

    def reply(self, out: RequestOutput) -> tuple[AssistantMessage, str | None]:
        """The message and finish reason of a finished choice: its tool calls parsed, if any."""
        parses = self.body.parses_tool_calls
        content, calls = hermes_tool_parser.parse(out.text) if parses else (out.text, [])
        message = AssistantMessage(content=content, tool_calls=calls)
        return message, "tool_calls" if calls else out.finish_reason

    def opening(self, index: int) -> ChatCompletionChunk:
        role = ChatDelta(role="assistant", content="")
        return ChatCompletionChunk(**self.header, choices=[ChatChunkChoice(index=index, delta=role)])

    def event(self, index: int, out: RequestOutput) -> ChatCompletionChunk | None:
        if self.body.parses_tool_calls:  # a call is only known whole: the reply comes as one chunk
            if not out.finished:
                return None
            message, reason = self.reply(out)
            calls = [ToolCallDelta(index=k, **c.model_dump()) for k, c in enumerate(message.tool_calls)]
            delta = ChatDelta(content=message.content, tool_calls=calls or None)
            entries = out.logprobs or []
        elif out.new_text or out.finished or (out.new_token_ids and self.body.logprobs):
            delta, reason = ChatDelta(content=out.new_text or None), out.finish_reason
            entries = new_logprobs(out)
        else:
            return None
        logprobs = self.logprobs(entries)
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=reason, logprobs=logprobs)
        return ChatCompletionChunk(**self.header, choices=[choice])

    def usage_event(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.header, choices=[], usage=usage)

    def final(self, outs: list[RequestOutput]) -> ChatCompletion:
        choices = []
        for i, out in enumerate(outs):
            message, reason = self.reply(out)
            entries = self.logprobs(out.logprobs or [])
            choices.append(ChatChoice(index=i, message=message, finish_reason=reason, logprobs=entries))
        return ChatCompletion(**self.header, choices=choices, usage=Usage.of(outs))
