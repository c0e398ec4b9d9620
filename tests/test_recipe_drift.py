"""The recipes' shared blocks stay identical, in the spirit of accelerate's `tests/test_examples.py`.

Each recipe is one file a user can copy, so the steps every recipe takes (the accelerator, the run's checkpoints and
guard, the loop's head, the optimizer step, the end) are written out in each. A block under a `# shared: <name>`
comment, up to the next blank line, must read the same in every recipe that has it; code repeated outside such
blocks (three lines or more) must be marked shared or moved into mmrecipes. In process: no recipe runs.
"""

import ast
import itertools
from pathlib import Path

RECIPES = Path(__file__).parents[1] / "recipes"
MARK = "# shared: "
IN_EVERY_RECIPE = {"accelerator", "run state", "optimizer step", "last evaluations", "the end"}
# vlm_grpo.py reads one batch of prompts a step (its completions fill the micro-batches): no `loop head`
READING_MICRO_BATCHES = {"clip_pretrain.py", "vlm_dpo.py", "vlm_finetune.py"}
LONGEST_UNMARKED_REPEAT = 2  # lines


def shared_blocks(text: str) -> dict[str, list[str]]:
    """{name: its lines} of every `# shared: <name>` block: the lines after the mark, up to the first blank one."""
    blocks, lines = {}, text.splitlines()
    for index, line in enumerate(lines):
        if line.strip().startswith(MARK):
            name = line.strip()[len(MARK):]
            assert name not in blocks, f"two blocks named {name!r}"
            blocks[name] = list(itertools.takewhile(str.strip, lines[index + 1:]))
    return blocks


def drift(texts: dict[str, str]) -> list[str]:
    """Each shared block that reads differently in some recipe than in the first recipe holding it (the first line
    that differs), and each block only one recipe holds."""
    holders = {}
    for recipe, text in texts.items():
        for name, lines in shared_blocks(text).items():
            holders.setdefault(name, []).append((recipe, lines))
    problems = []
    for name, held in holders.items():
        if len(held) == 1:
            problems.append(f"{name}: only {held[0][0]} has it; share it or drop the mark")
        (first, reference), *others = held
        for recipe, lines in others:
            if lines != reference:
                at = next(i for i, pair in enumerate(itertools.zip_longest(lines, reference)) if pair[0] != pair[1])
                problems.append(f"{name}: {recipe} differs from {first} at line {at + 1} of the block: "
                                f"{(lines[at:at + 1] or ['(nothing)'])[0].strip()!r} against "
                                f"{(reference[at:at + 1] or ['(nothing)'])[0].strip()!r}")
    return problems


def code_lines(text: str) -> list[str]:
    """A recipe's code: its argument dataclasses and `main`, without its docstring and imports (every recipe imports
    what it names), comments and blank lines."""
    body = ast.parse(text).body
    imports = {line for node in body if isinstance(node, (ast.Import, ast.ImportFrom))
               for line in range(node.lineno, node.end_lineno + 1)}
    docstring = set(range(body[0].lineno, body[0].end_lineno + 1)) if isinstance(body[0], ast.Expr) else set()
    return [line.strip() for number, line in enumerate(text.splitlines(), 1)
            if line.strip() and not line.strip().startswith("#") and number not in imports | docstring]


def unmarked_repeats(texts: dict[str, str]) -> list[str]:
    """Runs of more than LONGEST_UNMARKED_REPEAT consecutive code lines of a recipe (its argument dataclasses and
    `main`), outside its shared blocks, that another recipe holds too."""
    def code(text, unmarked):
        blocks = {line.strip() for lines in shared_blocks(text).values() for line in lines} if unmarked else set()
        return [line for line in code_lines(text) if line not in blocks]

    found, width = [], LONGEST_UNMARKED_REPEAT + 1
    for one, other in itertools.permutations(texts, 2):
        mine, theirs = code(texts[one], unmarked=True), code(texts[other], unmarked=False)
        seen = {tuple(theirs[i:i + width]) for i in range(len(theirs) - width + 1)}
        found += [f"{one} holds, unmarked, what {other} holds: {' / '.join(mine[i:i + width])}"
                  for i in range(len(mine) - width + 1) if tuple(mine[i:i + width]) in seen]
    return found


def recipe_texts() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(RECIPES.glob("*.py"))}


def test_shared_blocks_are_identical_and_nothing_else_repeats():
    texts = recipe_texts()
    assert len(texts) >= 3
    assert drift(texts) == []
    for recipe, text in texts.items():
        assert IN_EVERY_RECIPE | ({"loop head"} if recipe in READING_MICRO_BATCHES else set()) <= set(
            shared_blocks(text)), recipe
    assert unmarked_repeats(texts) == []
    for recipe, text in texts.items():  # the model is saved before the last evaluations: theirs never costs it
        saved = max(text.find("    save_vlm("), text.find("    save_contrastive("))
        assert 0 < saved < text.index("    # shared: last evaluations"), recipe


def test_a_shared_block_edited_in_one_recipe_alone_fails():
    texts = recipe_texts()
    texts["vlm_dpo.py"] = texts["vlm_dpo.py"].replace("        done = step + 1\n", "        done = step + 2\n", 1)
    assert drift(texts) == ["optimizer step: vlm_dpo.py differs from clip_pretrain.py at line 2 of the block: "
                            "'done = step + 2' against 'done = step + 1'"]
    texts = recipe_texts()
    texts["clip_pretrain.py"] = texts["clip_pretrain.py"].replace("    # shared: the end\n", "", 1)
    texts["vlm_finetune.py"] += "\n    # shared: mine\n    x = 1\n"
    assert drift(texts) == ["mine: only vlm_finetune.py has it; share it or drop the mark"]
    unmarked = recipe_texts()
    unmarked["vlm_dpo.py"] = unmarked["vlm_dpo.py"].replace("    # shared: run state\n", "", 1)
    assert unmarked_repeats(unmarked)[0].startswith("vlm_dpo.py holds, unmarked, what clip_pretrain.py holds: "
                                                    "guard = StepGuard(")
