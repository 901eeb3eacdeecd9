"""The tool-call grader on fixed, hand-checked cases: every verdict below was worked out by hand
from BFCL's checking rules (bfcl_eval/eval_checker/ast_eval/ast_checker.py) before the grader
ran, and every miss kind appears. Cases are written in BFCL's question/function/possible-answer
format (simple, multiple and parallel categories; function names with dots; parameter types
`dict`, `float`, `array`); the functions are our own, not copied from BFCL's data."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tasks.wire.replies import ChatReply, ToolCall
from tasks.correctness.tool_grader import MISS_KINDS, ToolCase, grade, load_suite, merge_bfcl, openai_tools, standardize


def fn(name: str, props: dict[str, dict], required: list[str]) -> dict:
    return {"name": name, "description": f"{name} (test)", "parameters": {"type": "dict", "properties": props,
                                                                          "required": required}}


TRIANGLE = fn("calculate_triangle_area", {"base": {"type": "integer"}, "height": {"type": "integer"},
                                          "unit": {"type": "string"}}, ["base", "height"])
FACTORIAL = fn("math.factorial", {"number": {"type": "integer"}}, ["number"])
CURVE = fn("calculate_area_under_curve", {"function": {"type": "string"},
                                          "interval": {"type": "array", "items": {"type": "float"}},
                                          "method": {"type": "string"}}, ["function", "interval"])
VELOCITY = fn("calculate_final_velocity", {"height": {"type": "integer"}, "initial_velocity": {"type": "integer"},
                                           "gravity": {"type": "float"}}, ["height"])
CONVERT = fn("convert_currency", {"amount": {"type": "float"}, "from": {"type": "string"},
                                  "to": {"type": "string"}}, ["amount", "from", "to"])
RECORDS = fn("db_fetch_records", {"database_name": {"type": "string"}, "conditions": {"type": "dict"},
                                  "fetch_limit": {"type": "integer"}}, ["database_name", "conditions"])
QUERY = fn("database.query", {"table": {"type": "string"},
                              "conditions": {"type": "array", "items": {"type": "dict"}}}, ["table", "conditions"])
PRIMES = fn("get_prime_factors", {"number": {"type": "integer"}, "formatted": {"type": "boolean"}},
            ["number", "formatted"])
QUADRATIC = fn("solve_quadratic", {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"},
                                   "root_type": {"type": "string"}}, ["a", "b", "c"])
HYPOT = fn("math.hypot", {"x": {"type": "integer"}, "y": {"type": "integer"}, "z": {"type": "integer"}}, ["x", "y"])
SORT = fn("sort_list", {"elements": {"type": "array", "items": {"type": "string"}}, "order": {"type": "string"}},
          ["elements"])
LOOKUP = fn("lookup_user", {"user_id": {"type": "integer"}}, ["user_id"])
COUNTRY = [fn("country_info.largest_city", {"country": {"type": "string"}}, ["country"]),
           fn("country_info.capital", {"country": {"type": "string"}}, ["country"]),
           fn("country_info.population", {"country": {"type": "string"}, "year": {"type": "integer"}}, ["country"])]
WEATHER = fn("get_weather", {"city": {"type": "string"}, "unit": {"type": "string"}}, ["city"])

GT = {
    "triangle": [{"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}],
    "factorial": [{"math.factorial": {"number": [5]}}],
    "curve": [{"calculate_area_under_curve": {"function": ["x**2", "lambda x: x**2"], "interval": [[1.0, 3.0]],
                                              "method": ["", "trapezoidal"]}}],
    "velocity": [{"calculate_final_velocity": {"height": [150], "initial_velocity": [0, ""], "gravity": [9.81, ""]}}],
    "convert": [{"convert_currency": {"amount": [100.0], "from": ["EUR", "Euro"], "to": ["USD"]}}],
    "records": [{"db_fetch_records": {"database_name": ["StudentDB"],
                                      "conditions": [{"department": ["Science"],
                                                      "school": ["Bluebird High School", "Bluebird HS"]}],
                                      "fetch_limit": ["", 0]}}],
    "query": [{"database.query": {"table": ["user"], "conditions": [[
        {"field": ["age"], "operation": [">"], "value": ["25"]},
        {"field": ["job"], "operation": ["="], "value": ["engineer"]}]]}}],
    "primes": [{"get_prime_factors": {"number": [450], "formatted": [True, ""]}}],
    "quadratic": [{"solve_quadratic": {"a": [3], "b": [-11], "c": [-4], "root_type": ["all"]}}],
    "hypot": [{"math.hypot": {"x": [4], "y": [5]}}],
    "sort": [{"sort_list": {"elements": [["Sam", "Alice", "Jack"]], "order": ["asc", ""]}}],
    "lookup": [{"lookup_user": {"user_id": ["uid"]}}],  # BFCL's "variable" case: a name, not a value
    "country": [{"country_info.capital": {"country": ["Brazil"]}}],
    "weather2": [{"get_weather": {"city": ["Paris"], "unit": ["celsius", ""]}},
                 {"get_weather": {"city": ["Oslo"], "unit": ["celsius", ""]}}],
}
FUNCTIONS = {"triangle": [TRIANGLE], "factorial": [FACTORIAL], "curve": [CURVE], "velocity": [VELOCITY],
             "convert": [CONVERT], "records": [RECORDS], "query": [QUERY], "primes": [PRIMES],
             "quadratic": [QUADRATIC], "hypot": [HYPOT], "sort": [SORT], "lookup": [LOOKUP], "country": COUNTRY,
             "weather2": [WEATHER]}
CATEGORY = {"country": "multiple", "weather2": "parallel"}


def case(key: str) -> ToolCase:
    return ToolCase(id=key, category=CATEGORY.get(key, "simple"), question=[[{"role": "user", "content": key}]],
                    function=FUNCTIONS[key], ground_truth=GT[key])


def calls(*pairs: tuple[str, dict | str], finish: str = "tool_calls", content: str = "") -> ChatReply:
    return ChatReply(ok=True, http_status=200, finish_reason=finish, content=content,
                     tool_calls=[ToolCall(name=n, arguments=a if isinstance(a, str) else json.dumps(a))
                                 for n, a in pairs])


def text(content: str, finish: str = "stop") -> ChatReply:
    return ChatReply(ok=True, http_status=200, finish_reason=finish, content=content)


SOLVED = "solved"
# (case, reply, expected verdict, why)
CASES: list[tuple[str, ChatReply, str, str]] = [
    # --- solved --------------------------------------------------------------------------------
    ("triangle", calls(("calculate_triangle_area", {"base": 10, "height": 5})), SOLVED,
     "required parameters, optional unit left out ('' allowed)"),
    ("triangle", calls(("calculate_triangle_area", {"base": 10, "height": 5, "unit": "units"})), SOLVED,
     "optional parameter given with an allowed value"),
    ("triangle", calls(("calculate_triangle_area", {"height": 5, "base": 10, "unit": "Units"})), SOLVED,
     "order of arguments is free; strings compare case-insensitively"),
    ("curve", calls(("calculate_area_under_curve", {"function": "x ** 2", "interval": [1.0, 3.0]})), SOLVED,
     "string normalisation removes spaces: 'x ** 2' is 'x**2'"),
    ("curve", calls(("calculate_area_under_curve", {"function": "lambda x: x**2", "interval": [1.0, 3.0],
                                                    "method": "trapezoidal"})), SOLVED,
     "second acceptable string; optional method given"),
    ("curve", calls(("calculate_area_under_curve", {"function": "x**2", "interval": [1, 3]})), SOLVED,
     "JSON has one number type: [1, 3] equals [1.0, 3.0]"),
    ("convert", calls(("convert_currency", {"amount": 100, "from": "EUR", "to": "USD"})), SOLVED,
     "an int is accepted for a float parameter"),
    ("convert", calls(("convert_currency", {"amount": 100.0, "from": "euro", "to": "usd"})), SOLVED,
     "float for float; strings normalised"),
    ("velocity", calls(("calculate_final_velocity", {"height": 150})), SOLVED,
     "both optional parameters left out"),
    ("velocity", calls(("calculate_final_velocity", {"height": 150, "initial_velocity": 0, "gravity": 9.81})),
     SOLVED, "optional parameters given with their allowed values"),
    ("records", calls(("db_fetch_records", {"database_name": "StudentDB",
                                            "conditions": {"department": "Science", "school": "Bluebird HS"}})),
     SOLVED, "dict parameter: every key acceptable"),
    ("records", calls(("db_fetch_records", {"database_name": "studentdb", "fetch_limit": 0,
                                            "conditions": {"school": "bluebird high-school",
                                                           "department": "science"}})),
     SOLVED, "dict values normalised ('high-school' is 'highschool'); optional limit given"),
    ("query", calls(("database_query", {"table": "user", "conditions": [
        {"field": "age", "operation": ">", "value": "25"}, {"field": "job", "operation": "=", "value": "engineer"}]})),
     SOLVED, "list of dicts, each dict acceptable; dotted name answered in its wire form"),
    ("primes", calls(("get_prime_factors", {"number": 450, "formatted": True})), SOLVED, "boolean given"),
    ("factorial", calls(("math_factorial", {"number": 5})), SOLVED, "'math.factorial' is offered as 'math_factorial'"),
    ("factorial", calls(("math.factorial", {"number": 5})), SOLVED, "the original dotted name is accepted too"),
    ("hypot", calls(("math_hypot", {"x": 4, "y": 5})), SOLVED, "optional z not in the answer, left out"),
    ("sort", calls(("sort_list", {"elements": ["sam", "alice", "jack"]})), SOLVED,
     "list elements normalised one by one"),
    ("lookup", calls(("lookup_user", {"user_id": "uid"})), SOLVED,
     "BFCL's variable case: a string where the schema says integer, matching the answer's string"),
    ("country", calls(("country_info_capital", {"country": "Brazil"})), SOLVED,
     "multiple: the right function chosen among three"),
    ("weather2", calls(("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Paris", "unit": "celsius"})),
     SOLVED, "parallel: both expected calls, in any order"),
    ("factorial", calls(("math_factorial", {"number": 5}), content="Let me compute that."), SOLVED,
     "text beside a correct call does not matter"),
    ("factorial", calls(("math_factorial", {"number": 5}), finish="length"), SOLVED,
     "a complete, correct call counts even if the model rambled on to max_tokens"),
    # --- http_error ----------------------------------------------------------------------------
    ("factorial", ChatReply(ok=False, http_status=500, error="The model produced output that does not match"),
     "http_error", "server error"),
    ("factorial", ChatReply(ok=False, http_status=400, error="tools param requires --jinja flag"), "http_error",
     "refused request"),
    ("factorial", ChatReply(ok=False, error="ConnectError: connection refused"), "http_error", "no HTTP answer"),
    # --- truncated -----------------------------------------------------------------------------
    ("factorial", text("I will call math_factorial with number", finish="length"), "truncated",
     "cut off before any call"),
    ("convert", calls(("convert_currency", '{"amount": 100, "from": "EUR", "to":'), finish="length"), "truncated",
     "cut off inside the call: arguments incomplete"),
    # --- no_call -------------------------------------------------------------------------------
    ("factorial", text("The factorial of 5 is 120."), "no_call", "answered in text"),
    ("factorial", text('<tool_call>{"name": "math_factorial", "arguments": {"number": 5}}</tool_call>'), "no_call",
     "call markup left in the text: the server parsed no call (the seeds' missing parser)"),
    # --- malformed_call ------------------------------------------------------------------------
    ("factorial", calls(("math_factorial", "number=5")), "malformed_call", "arguments are not JSON"),
    ("factorial", calls(("math_factorial", "[5]")), "malformed_call", "arguments are JSON but not an object"),
    # --- wrong_count ---------------------------------------------------------------------------
    ("factorial", calls(("math_factorial", {"number": 5}), ("math_factorial", {"number": 6})), "wrong_count",
     "two calls where one is expected"),
    ("weather2", calls(("get_weather", {"city": "Paris"})), "wrong_count", "parallel: one of two calls missing"),
    # --- wrong_function ------------------------------------------------------------------------
    ("country", calls(("country_info_largest_city", {"country": "Brazil"})), "wrong_function",
     "multiple: a sibling function chosen"),
    ("factorial", calls(("factorial", {"number": 5})), "wrong_function", "a name that was never offered"),
    # --- missing_argument ----------------------------------------------------------------------
    ("triangle", calls(("calculate_triangle_area", {"base": 10})), "missing_argument", "required height left out"),
    ("quadratic", calls(("solve_quadratic", {"a": 3, "b": -11, "c": -4})), "missing_argument",
     "root_type is optional in the schema, but the question asked for it and the answer has no ''"),
    ("velocity", calls(("calculate_final_velocity", {"gravity": 9.81})), "missing_argument",
     "required height left out (reported before anything else)"),
    # --- unexpected_argument -------------------------------------------------------------------
    ("factorial", calls(("math_factorial", {"number": 5, "precision": 2})), "unexpected_argument",
     "a parameter the function does not take"),
    ("hypot", calls(("math_hypot", {"x": 4, "y": 5, "z": 0})), "unexpected_argument",
     "z exists but the answer does not allow it"),
    # --- wrong_value ---------------------------------------------------------------------------
    ("triangle", calls(("calculate_triangle_area", {"base": 11, "height": 5})), "wrong_value", "wrong number"),
    ("triangle", calls(("calculate_triangle_area", {"base": "10", "height": 5})), "wrong_value",
     "a string where an integer is expected"),
    ("triangle", calls(("calculate_triangle_area", {"base": 10.5, "height": 5})), "wrong_value",
     "a float where an integer is expected"),
    ("factorial", calls(("math_factorial", {"number": True})), "wrong_value", "a boolean is not an integer"),
    ("triangle", calls(("calculate_triangle_area", {"base": 10, "height": 5, "unit": "cm"})), "wrong_value",
     "optional parameter given with a value the answer does not allow"),
    ("convert", calls(("convert_currency", {"amount": 100, "from": "GBP", "to": "USD"})), "wrong_value",
     "wrong string"),
    ("records", calls(("db_fetch_records", {"database_name": "StudentDB",
                                            "conditions": {"department": "Arts", "school": "Bluebird HS"}})),
     "wrong_value", "dict value outside the acceptable ones"),
    ("records", calls(("db_fetch_records", {"database_name": "StudentDB",
                                            "conditions": {"department": "Science", "school": "Bluebird HS",
                                                           "grade": "9"}})),
     "wrong_value", "dict with a key the answer does not have"),
    ("sort", calls(("sort_list", {"elements": ["Alice", "Jack", "Sam"]})), "wrong_value",
     "list in an order the answer does not allow"),
    ("primes", calls(("get_prime_factors", {"number": 450, "formatted": "true"})), "wrong_value",
     "the string 'true' is not a boolean"),
    ("weather2", calls(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Bergen"})), "wrong_value",
     "parallel: one of the two calls has a wrong city"),
]


@pytest.mark.parametrize("key,reply,expected,why", CASES, ids=[f"{i:02d}-{c[0]}-{c[2]}" for i, c in enumerate(CASES)])
def test_hand_checked_verdicts(key, reply, expected, why):
    verdict = grade(case(key), reply)
    got = SOLVED if verdict.solved else verdict.kind
    assert got == expected, f"{why}: grader said {got} ({verdict.detail})"
    assert verdict.solved or verdict.detail  # a miss always says what was wrong


def test_fixed_set_is_large_and_covers_every_miss_kind():
    kinds = Counter(expected for _, _, expected, _ in CASES)
    assert len(CASES) >= 40
    assert set(MISS_KINDS) | {SOLVED} == set(kinds), kinds
    assert kinds[SOLVED] >= 15


def test_string_normalisation_is_bfcls():
    assert standardize("April 1, 2024") == standardize("april 1 2024") == "april12024"
    assert standardize("New-York_City.") == "newyorkcity"
    assert standardize("it's") == 'it"s'


def test_tools_are_sent_as_json_schema_with_wire_names():
    (tool,) = openai_tools(case("factorial"))
    assert tool == {"type": "function", "function": {
        "name": "math_factorial", "description": "math.factorial (test)",
        "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]}}}
    (curve,) = openai_tools(case("curve"))
    assert curve["function"]["parameters"]["properties"]["interval"] == {"type": "array", "items": {"type": "number"}}
    assert "strict" not in curve["function"]  # strict stays off unless the protocol says otherwise
    assert openai_tools(case("curve"), strict=True)[0]["function"]["strict"] is True


def test_suites_load_from_bfcl_files_and_bad_lines_are_named(tmp_path):
    questions = tmp_path / "BFCL_v4_simple_python.json"
    answers = tmp_path / "possible_answer.json"
    questions.write_text(json.dumps({"id": "simple_python_0", "question": [[{"role": "user", "content": "5!"}]],
                                     "function": [FACTORIAL]}) + "\n")
    answers.write_text(json.dumps({"id": "simple_python_0", "ground_truth": GT["factorial"]}) + "\n")
    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps(line) + "\n" for line in merge_bfcl(questions, answers, "simple")))
    (loaded,) = load_suite(suite)
    assert loaded.category == "simple" and loaded.ground_truth == GT["factorial"]
    assert grade(loaded, calls(("math_factorial", {"number": 5}))).solved

    bad = tmp_path / "bad.jsonl"
    good = suite.read_text()
    for line, message in [("{not json", "line 2: not JSON"),
                          (json.dumps({**json.loads(good), "id": "x", "function": [FACTORIAL, TRIANGLE]}),
                           "line 2: a simple case offers one function"),
                          (json.dumps({**json.loads(good), "id": "y",
                                       "ground_truth": [{"math.factorial": {"n": [5]}}]}),
                           "line 2: ground_truth names parameter 'n'"),
                          (good.strip(), "line 2: id 'simple_python_0' appears twice")]:
        bad.write_text(good + line + "\n")
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            load_suite(bad)


def test_shipped_suites_load():
    from tasks.inventory.paths import REPO

    for name in ("testbed-dev.jsonl", "testbed-held-out.jsonl"):
        cases = load_suite(REPO / "toolsuites" / name)
        assert 20 <= len(cases) <= 40
        assert {c.category for c in cases} == {"simple", "multiple"}
