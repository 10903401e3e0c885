"""A rule-based reward for examples/grpo_loop.py on the demo arithmetic prompts ("Add a and
b."): 1 for a completion that states the sum as a number of its own, else half the share of
its characters that are digits (partial credit for an answer's form, which a policy
starting from random weights can climb; an all-digit answer without the sum gets 0.5, so a
mean reward above 0.5 needs right sums). `reward(prompt, completion, answer) -> float` is
what the loop calls.
"""
import re


def reward(prompt: str, completion: str, answer: int) -> float:
    text = completion.strip()
    if re.search(rf"(?<!\d){answer}(?!\d)", text):
        return 1.0
    if not text:
        return 0.0
    return 0.5 * sum(c.isdigit() for c in text) / len(text)
