"""data.summary_docstrings: the training-text transform that cuts docstrings to their first
paragraph (clover-tiny v2, part 5)."""

from __future__ import annotations

import ast

from clover_gguf.train.data import summary_docstrings


def docstrings(src: str) -> list[str]:
    tree = ast.parse(src)
    return [
        ast.get_docstring(n, clean=False)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and ast.get_docstring(n, clean=False) is not None
    ]


def test_cuts_every_kind_of_docstring_to_its_first_paragraph():
    src = (
        '"""Module summary.\n\nMore about the module.\n"""\n'
        "\n"
        "class A:\n"
        "    '''Class summary\n"
        "    on two lines.\n"
        "\n"
        "    Details.\n"
        "    '''\n"
        "\n"
        "    async def m(self):\n"
        '        r"""\n'
        "        Summary after the quotes, \\d raw.\n"
        "\n"
        "        Details.\n"
        '        """\n'
        "        return 1  # the code after stays\n"
    )
    out, n = summary_docstrings(src)
    assert n == 3
    assert docstrings(out) == [
        "Module summary.",
        "Class summary\n    on two lines.",
        "\n        Summary after the quotes, \\d raw.",
    ]
    assert "'''Class summary\n    on two lines.'''\n" in out  # the docstring's own quotes close it
    assert '        r"""\n        Summary after the quotes, \\d raw."""\n' in out
    assert out.endswith("        return 1  # the code after stays\n")


def test_leaves_short_docstrings_and_other_strings_alone():
    src = (
        'def f():\n    """One line."""\n\n'
        'def g():\n    """One paragraph\n    on two lines.\n    """\n\n'
        'def h():\n    x = """not a\n\n    docstring"""\n'
    )
    assert summary_docstrings(src) == (src, 0)


def test_lines_are_counted_as_ast_counts_them():
    # a form feed is a line break to str.splitlines but not to the parser
    src = '\x0c\ndef f():\n    """Summary.\x0c\n\n    Details.\n    """\n    return 1\n'
    out, n = summary_docstrings(src)
    assert n == 1
    assert out == '\x0c\ndef f():\n    """Summary.\x0c"""\n    return 1\n'


def test_a_cut_that_would_not_parse_is_not_made():
    src = 'def f():\n    """Ends in a quote "x"\n\n    Details.\n    """\n'  # """...x"""" would not close
    assert summary_docstrings(src) == (src, 0)
    broken = 'def f(:\n    """Summary.\n\n    Details.\n    """\n'
    assert summary_docstrings(broken) == (broken, 0)
