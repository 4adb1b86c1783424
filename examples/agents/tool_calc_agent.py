"""A tool-using agent for the tool-calculator task, written against the OpenAI client as any agent is: it sends the
question with the calculator's function schema, runs the calculator itself when the model calls it, sends the
result back as a ``tool`` message and lets the model answer. It knows nothing about training.

``examples/grpo_tool_calc_agent.yaml`` trains the model through it (``rollout.agent.entry``): the trainer starts an
OpenAI-compatible endpoint in front of its rollout engine and calls :func:`run` once per sample with that endpoint's
``base_url``, a per-sample ``api_key`` and the sample's fields. Returning None lets ``reward.function`` (tool_calc)
score the trajectory the endpoint recorded. Run it by hand against any OpenAI-compatible server:
``python examples/agents/tool_calc_agent.py http://127.0.0.1:8000/v1 KEY "12*34"``.
"""

from __future__ import annotations

import ast
import json
import operator
import sys
from typing import Any

import openai

# the schema the model was fine-tuned with (examples/sft_tool_calc.yaml renders the calculator tool's own schema)
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly, e.g. 123*456.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "numbers, + - * / // % ** and parentheses"}}, "required": ["expression"]}}}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or an error message the model reads."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"unsupported expression: {ast.dump(node)[:40]}")

    try:
        return str(value(ast.parse(str(expression), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"Error: {exc}"


def run(base_url: str, api_key: str, sample: dict[str, Any], *, max_turns: int = 2) -> None:
    """Ask, call the calculator when the model asks for it, up to ``max_turns`` model turns, ending early when the
    conversation no longer fits the model's context (``context_length_exceeded``); None: the trainer's reward
    function scores the final answer."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(sample["prompt"])
    for _ in range(max_turns):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR],
                                                   temperature=1.0, max_tokens=40)
        except openai.BadRequestError as error:
            if error.code != "context_length_exceeded":
                raise
            break  # the conversation filled the model's context: it ends here, as any chat client's would
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    return None


if __name__ == "__main__":
    url, key, question = sys.argv[1:4]
    run(url, key, {"prompt": [{"role": "user", "content": question}]})
