import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from skip_core.backend import find_backend
from skip_core.config import ConfigError
from skip_core.hookspecs import hookimpl
from skip_core.plugins import load_plugins
from skip_plugin_arithmetic.calculator import Calculator, CalculatorError, evaluate
from skip_plugin_trainer.rollout.tools import HermesParser, Tool, ToolCall, ToolResponse, load_tools, tool_parser


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("4821 * 37", "178377"),
        ("(12 + 7) * 3 - 100", "-43"),
        ("-5 + +2", "-3"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.3333333333"),
        ("7 // 2", "3"),
        ("17 % 5", "2"),
        ("2 ** 10", "1024"),
        ("0.1 + 0.2", "0.3"),
        ("2 ** -2", "0.25"),
    ],
)
def test_calculator_is_exact(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "unsupported syntax"),
        ("open('/etc/passwd')", "unsupported syntax"),
        ("(1).__class__", "unsupported syntax"),
        ("x + 1", "unsupported syntax"),
        ("[1, 2]", "unsupported syntax"),
        ("'a' * 3", "unsupported syntax"),
        ("True + 1", "unsupported syntax"),
        ("1 +", "not an arithmetic expression"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "exponent must be an integer of at most 64"),
        ("2 ** 0.5", "exponent must be an integer"),
        ("99999999999 ** 64", "more than 60 digits"),
        ("1" * 201, "longer than 200 characters"),
    ],
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expression, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate(expression)


@given(st.integers(-(10**8), 10**8), st.integers(-(10**8), 10**8), st.sampled_from("+-*"))
def test_calculator_matches_python_on_integers(a, b, op):
    expected = {"+": a + b, "-": a - b, "*": a * b}[op]
    assert evaluate(f"{a} {op} ({b})") == str(expected)


def test_calculator_tool_executes_and_rejects_bad_arguments():
    tool = Calculator()
    assert tool.name == "calculator"
    assert asyncio.run(tool.execute("r", {"expression": "6 * 7"})).text == "42"
    with pytest.raises(CalculatorError, match="arguments must be"):
        asyncio.run(tool.execute("r", {"expr": "6 * 7"}))


def test_hermes_parser_keeps_well_formed_calls_and_drops_malformed_ones():
    parser = HermesParser()
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>'
        "<tool_call>{not json}</tool_call>"
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
    )
    assert parser.has_tool_call(text)
    content, calls = parser.parse(text)
    assert content == "Let me compute."
    assert calls == [ToolCall("calculator", {"expression": "1 + 2"}), ToolCall("calculator", {"expression": "3"})]
    assert not parser.has_tool_call("Answer: 3")
    assert parser.parse("Answer: 3") == ("Answer: 3", [])


def test_tools_yaml_builds_registered_tools_with_schema_override(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - name: calculator\n"
        "    config: {precision: 3}\n"
        "    schema: {type: function, function: {name: calc, description: arithmetic}}\n"
    )
    tools = load_tools(path)
    assert list(tools) == ["calc"]
    assert isinstance(tools["calc"], Calculator) and tools["calc"].config == {"precision": 3}
    assert Calculator.schema["function"]["name"] == "calculator"  # replaced on the instance only
    assert load_tools(None) == {}


ECHO_SCHEMA = {"type": "function", "function": {"name": "echo", "description": "repeat the text"}}


class Echo(Tool):
    schema = ECHO_SCHEMA

    async def execute(self, request_id, arguments, **_):
        return ToolResponse(self.config["prefix"] + arguments["text"])


class EchoPlugin:
    """A third-party tool written to the hookspec's documented contract: ``factory(config) -> Tool``."""

    @hookimpl
    def skip_register_tools(self, register):
        register("echo", lambda config: Echo(config))
        register("broken", lambda config: "not a tool")


@pytest.fixture
def echo_plugin():
    pm = load_plugins()
    plugin = EchoPlugin()
    pm.register(plugin)
    yield
    pm.unregister(plugin)


def test_a_tool_factory_written_to_the_documented_signature_works(tmp_path, echo_plugin):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - name: echo\n    config: {prefix: '> '}\n")
    tools = load_tools(path)
    assert tools["echo"].schema == Echo.schema
    assert asyncio.run(tools["echo"].execute("r", {"text": "hi"})).text == "> hi"


def test_a_tool_factory_returning_something_else_names_the_tool(tmp_path, echo_plugin):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - name: broken\n")
    with pytest.raises(ConfigError, match=r"factory of tool 'broken' returned str, not a Tool"):
        load_tools(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tools:\n  - name: search\n", r"unknown tool 'search' \(installed tools: .*calculator"),
        ("tools:\n  - class_name: verl.tools.Gsm8kTool\n", "expected `tools: "),
        ("tools: 3\n", "expected `tools: "),
        ("tools: [\n", "expected `tools: "),
    ],
)
def test_tools_yaml_errors_name_the_file(tmp_path, text, message):
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{path}: {message}"):
        load_tools(path)


def test_missing_tools_yaml_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.multi_turn\.tools_config: no such file"):
        load_tools(tmp_path / "nope.yaml")


def test_unknown_parser_names_the_key_and_the_installed_ones():
    assert isinstance(tool_parser("hermes"), HermesParser)
    with pytest.raises(ConfigError, match=r"rollout\.multi_turn\.format: unknown tool-call format 'xml' \(installed: "):
        tool_parser("xml")


def test_unknown_backend_lists_installed_and_says_how_to_install_one_this_repository_ships():
    hint = r"unknown backend 'hf' \(installed: mine\); install skip-plugin-hf from a clone"
    with pytest.raises(ConfigError, match=hint):
        find_backend("hf", {"mine": object})
    vllm = r"unknown backend 'vllm' \(installed: hf\); install skip-plugin-vllm from a clone .* ./plugins/vllm$"
    with pytest.raises(ConfigError, match=vllm):
        find_backend("vllm", {"hf": object})
    with pytest.raises(ConfigError, match=r"unknown backend 'tgi' \(installed: hf\)$"):  # not one we ship
        find_backend("tgi", {"hf": object})
    assert find_backend("hf", {"hf": object}) is object
