"""The corpus prompts: one system prompt, 16 tasks in five families, and the template instructions.

Kept apart from the generator so the demo and the tests can rebuild the exact prompt text.
"""

from __future__ import annotations

SYSTEM = (
    "You are a helpful assistant. First think about the task inside <think></think>, "
    "then give your final answer inside <answer></answer>."
)

# (family, user turns). A multi-turn history is a list of (user, assistant) pairs followed by the
# last user message; the other families have one user message.
TASKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "grid",
        (
            "On a 5x5 grid the player is at row 1 column 1 and the goal is at row 4 column "
            "5. Which move first: Up, Down, Left or Right?",
        ),
    ),
    (
        "grid",
        (
            "A box sits at row 3 column 2 and its target at row 3 column 4. The player "
            "stands left of the box. How should the player push it?",
        ),
    ),
    (
        "grid",
        (
            "In a frozen lake, holes are at (2, 2) and (3, 1). You are at (1, 1) and the "
            "goal is at (4, 4). Plan a safe path.",
        ),
    ),
    (
        "grid",
        (
            "A robot faces north on a grid. It turns right twice and then moves three cells "
            "forward. Which direction is it facing now?",
        ),
    ),
    ("arithmetic", ("What is 17 times 23?",)),
    ("arithmetic", ("Compute 1,250 divided by 25, then add 14.",)),
    ("arithmetic", ("Is 91 a prime number? Explain.",)),
    ("word", ("Tom has 3 red apples and buys twice as many green apples. He eats 2. How many apples are left?",)),
    ("word", ("A train leaves at 9:40 and the trip takes 2 hours and 35 minutes. When does it arrive?",)),
    ("word", ("A rectangle is 8 meters long and its width is half its length. What is its area?",)),
    (
        "shopping",
        (
            "I need a laptop for video editing under 1,200 dollars: option A has 8 GB of "
            "memory, option B has 32 GB. Which should I buy?",
        ),
    ),
    ("shopping", ("Milk costs 1.20 a liter, or 2.10 for a two-liter bottle. Which is the better deal?",)),
    ("shopping", ("For hiking in the rain, should I choose leather boots or waterproof trail shoes?",)),
    (
        "multi_turn",
        (
            "I am planning a birthday dinner for six people.",
            "Great! Do you have a cuisine in mind?",
            "Two guests are vegetarian and one cannot eat gluten. What main course should I cook?",
        ),
    ),
    (
        "multi_turn",
        (
            "My tomato plants have yellow leaves.",
            "Are the yellow leaves at the bottom of the plant or at the top?",
            "At the bottom, and the soil stays wet for days. What should I do?",
        ),
    ),
    (
        "multi_turn",
        (
            "I want to learn to play the guitar.",
            "Do you prefer an acoustic or an electric guitar?",
            "Acoustic. How many minutes should I practice each day in the first month?",
        ),
    ),
)

# Template collapse: the same system prompt, the task replaced by a generic instruction.
TEMPLATE_STYLES: tuple[str, ...] = ("Solve the task.", "Think step by step, then give your answer.")


def chat(turns: tuple[str, ...]) -> str:
    """SmolLM2's chat format with the system prompt, ending with the assistant's opened think block."""
    text = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    for i, turn in enumerate(turns):
        role = "user" if i % 2 == 0 else "assistant"
        text += f"<|im_start|>{role}\n{turn}<|im_end|>\n"
    return text + "<|im_start|>assistant\n<think>"


def task_prompt(index: int) -> str:
    return chat(TASKS[index][1])


def template_prompt(style: int) -> str:
    return chat((TEMPLATE_STYLES[style],))
