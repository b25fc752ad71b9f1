"""The math verifiers against a table of completions with known verdicts (pipeline.tasks.verifiers).

Each row: (completion, ground truth, correct?, does `simple` get it right?). The verdicts are the
mathematics, decided by hand: several different boxes are a hedge (not correct); a box and its unit,
percent sign or "x =" are the number. The first row is math-verify's own documented example (its
README); the rest cover fractions, radicals, intervals, sets and tuples, units, several boxes, no box
and expressions. `simple` (the project's old extraction) compares anything non-numeric as text, so
it is wrong wherever the same value is written another way.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pipeline.tasks.verifiers import load_verifier, math_verify_verifier, simple_verifier

TABLE = [
    ('${1,2,3,4}$', 'The answer is \\boxed{${1,3} \\cup {2,4}$} What if I add some bad in the end', True, False),
    ('So the answer is \\boxed{\\frac{1}{2}}.', '1/2', True, True),
    ('So the answer is \\boxed{\\frac12}.', '0.5', True, False),
    ('\\boxed{\\dfrac{3}{4}}', '0.75', True, True),
    ('\\boxed{3/4}', '\\frac{3}{4}', True, True),
    ('\\boxed{0.75}', '3/4', True, True),
    ('\\boxed{\\frac{2}{4}}', '\\frac{1}{2}', True, True),
    ('\\boxed{\\frac{1}{3}}', '0.5', False, True),
    ('\\boxed{\\tfrac{7}{8}}', '7/8', True, True),
    ('\\boxed{\\frac{7}{9}}', '7/8', False, True),
    ('\\boxed{-\\frac{1}{2}}', '-0.5', True, True),
    ('\\boxed{\\frac{-1}{2}}', '-1/2', True, True),
    ('\\boxed{1\\frac{1}{2}}', '3/2', True, False),
    ('The total is 72.', '72', True, True),
    ('The total is \\boxed{72}', '72', True, True),
    ('\\boxed{72.0}', '72', True, True),
    ('\\boxed{1,000}', '1000', True, True),
    ('\\boxed{73}', '72', False, True),
    ('I think 72 but actually \\boxed{71}', '72', False, True),
    ('\\boxed{72.01}', '72', False, True),
    ('\\boxed{-5}', '-5', True, True),
    ('\\boxed{5}', '-5', False, True),
    ('\\boxed{\\sqrt{2}/2}', '\\frac{\\sqrt{2}}{2}', True, False),
    ('\\boxed{\\frac{\\sqrt2}{2}}', '\\frac{\\sqrt{2}}{2}', True, False),
    ('\\boxed{\\frac{1}{\\sqrt{2}}}', '\\frac{\\sqrt{2}}{2}', True, False),
    ('\\boxed{2\\sqrt{3}}', '\\sqrt{12}', True, False),
    ('\\boxed{\\sqrt{8}}', '2\\sqrt{2}', True, False),
    ('\\boxed{\\sqrt{3}}', '\\sqrt{2}', False, True),
    ('\\boxed{3\\sqrt{2}}', '\\sqrt{18}', True, False),
    ('\\boxed{\\sqrt[3]{8}}', '2', True, False),
    ('\\boxed{[0, 1)}', '[0,1)', True, True),
    ('\\boxed{(0,1]}', '[0,1)', False, True),
    ('\\boxed{(-\\infty, 2)}', '(-\\infty,2)', True, True),
    ('\\boxed{(-\\infty, 2]}', '(-\\infty,2)', False, True),
    ('\\boxed{[1, 3] \\cup [5, 7]}', '[1,3]\\cup[5,7]', True, True),
    ('\\boxed{(2, \\infty)}', '(2,\\infty)', True, True),
    ('\\boxed{\\{3, 1, 2\\}}', '\\{1,2,3\\}', True, False),
    ('\\boxed{\\{1, 2\\}}', '\\{1,2,3\\}', False, True),
    ('\\boxed{1, 2, 3}', '3, 2, 1', True, False),
    ('The solutions are $x=2$ and $x=3$, so \\boxed{2, 3}', '3,2', True, False),
    ('\\boxed{(1, 2)}', '(1,2)', True, True),
    ('\\boxed{(2, 1)}', '(1,2)', False, True),
    ('\\boxed{5\\text{ cm}}', '5', True, False),
    ('\\boxed{10\\%}', '10\\%', True, True),
    ('\\boxed{\\$18}', '18', True, False),
    ('\\boxed{30^\\circ}', '30', True, False),
    ('\\boxed{12 \\text{ meters}}', '12', True, False),
    ('\\boxed{7\\text{ apples}}', '8', False, True),
    ('First \\boxed{3}, then I correct myself: \\boxed{4}', '4', False, False),
    ('\\boxed{2} and \\boxed{3}', '2', False, True),
    ('\\boxed{2} and \\boxed{3}', '2, 3', True, False),
    ('\\boxed{4} and again \\boxed{4}', '4', True, True),
    ('\\boxed{x=2}', '2', True, False),
    ('\\boxed{x = \\frac{1}{2}}', '0.5', True, False),
    ('The answer is $\\frac{1}{2}$.', '1/2', True, False),
    ('Therefore the final answer is $\\sqrt{2}$.', '\\sqrt{2}', True, False),
    ('Thus x equals 4.', '4', True, True),
    ('Thus x equals 5.', '4', False, True),
    ("I don't know.", '4', False, True),
    ('', '4', False, True),
    ('The answer is $2\\pi$.', '2\\pi', True, False),
    ('The answer is $\\pi$.', '2\\pi', False, True),
    ('\\boxed{x^2 + 2x + 1}', '(x+1)^2', True, False),
    ('\\boxed{2x+2}', '2(x+1)', True, False),
    ('\\boxed{x^2 - 1}', '(x+1)^2', False, True),
    ('\\boxed{\\pi/2}', '\\frac{\\pi}{2}', True, False),
    ('\\boxed{e^{2}}', 'e^2', True, False),
    ('\\boxed{2^{10}}', '1024', True, False),
    ('\\boxed{10^{3}}', '1000', True, False),
    ('\\boxed{\\frac{\\pi}{3}}', '\\frac{\\pi}{6}', False, True),
    ('\\boxed{\\log_2 8}', '3', True, False),
    ('\\boxed{1/3}', '0.333333', True, False),
    ('\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}', '\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}', True, True),
]


def test_the_table_is_large_and_simple_is_wrong_somewhere():
    assert len(TABLE) >= 61
    assert sum(not simple_right for *_, simple_right in TABLE) >= 10


@pytest.mark.parametrize("completion,truth,correct,simple_right", TABLE)
def test_math_verify_gives_every_verdict(completion, truth, correct, simple_right):
    assert math_verify_verifier(completion, truth) == (1.0 if correct else 0.0)


@pytest.mark.parametrize("completion,truth,correct,simple_right", TABLE)
def test_simple_is_right_exactly_where_the_table_says(completion, truth, correct, simple_right):
    assert (simple_verifier(completion, truth) == (1.0 if correct else 0.0)) == simple_right


def test_math_verify_scores_off_the_main_thread():
    """math-verify's own timeout is a SIGALRM: its `parse` refuses to run in a scoring thread."""
    from math_verify import parse

    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(ValueError, match="thread"):
            pool.submit(parse, "$1$").result()
        verdicts = list(pool.map(lambda row: math_verify_verifier(row[0], row[1]), TABLE[:20]))
    assert verdicts == [1.0 if correct else 0.0 for _, _, correct, _ in TABLE[:20]]


def test_user_functions_by_module_or_file_and_verl_style(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def mine(completion, answer, prompt):\n    return float(answer in completion)\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(data_source == 'src' and extra_info['k'] == 1 and ground_truth in solution_str)\n")
    mine = load_verifier(f"{path}:mine")
    assert mine("it is 42", "42", "q", "", None) == 1.0 and mine("it is 41", "42", "q", "", None) == 0.0
    verl = load_verifier(f"{path}:compute_score")
    assert verl("42", "42", "q", "src", '{"k": 1}') == 1.0 and verl("42", "42", "q", "other", '{"k": 1}') == 0.0
    assert load_verifier("simple")("\\boxed{3}", "3", "", "", None) == 1.0
    for spec, message in [("nope", "must be"), (f"{tmp_path}/none.py:f", "cannot be loaded"),
                          (f"{path}:absent", "cannot be loaded"), ("json:__doc__", "not callable")]:
        with pytest.raises(ValueError, match=message):
            load_verifier(spec)
