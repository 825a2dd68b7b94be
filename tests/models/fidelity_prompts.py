"""Prompts of 5 to ~1,500 tokens for the fidelity tests (real English text, varied)."""

from __future__ import annotations

PARAGRAPHS = [
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "panels, then by punched cards, and later by symbolic assemblers that let people name memory "
    "locations instead of remembering their addresses. Each step let programmers think about larger problems.",
    "Rivers shape the land they cross. Over thousands of years a river cuts valleys, deposits silt on its "
    "flood plains and builds deltas where it meets the sea. Farmers have settled along rivers since the first "
    "cities, because the water and the fertile soil made harvests reliable.",
    "A good recipe for bread needs only flour, water, salt and yeast, but the baker's patience matters "
    "most. The dough must rest so the gluten can develop, and it must rise slowly in a warm place before "
    "it is shaped, proofed again and baked in a very hot oven until the crust sings as it cools.",
    "In distributed systems, failures are normal rather than exceptional. Networks drop packets, disks fill "
    "up, and processes are restarted by schedulers without warning. Engineers therefore design services to "
    "retry with backoff, to shed load when overwhelmed, and to keep serving even when a dependency is slow.",
    "The migration of birds has fascinated observers for centuries. Some species fly thousands of kilometres "
    "each year, navigating by the sun, the stars and the Earth's magnetic field. Young birds often make "
    "their first journey alone, guided by instinct rather than by older members of the flock.",
    "Mathematics rewards curiosity. A student who asks why a formula works, rather than only how to use it, "
    "often discovers connections between topics that seemed unrelated: geometry and algebra, probability "
    "and counting, calculus and the physics of motion.",
]

SHORT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the ocean.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Question: What are three benefits of regular exercise?\nAnswer:",
]


def long_prompt(num_paragraphs: int, offset: int) -> str:
    parts = [PARAGRAPHS[(offset + i) % len(PARAGRAPHS)] for i in range(num_paragraphs)]
    return "\n\n".join(parts) + "\n\nSummarize the text above in one sentence:"


def fidelity_prompts() -> list[str]:
    """Twelve prompts from ~5 to ~1,500 tokens with the default model's tokenizer."""
    return SHORT_PROMPTS + [long_prompt(n, n) for n in (1, 2, 4, 7, 11, 16, 21)] + [long_prompt(26, 3)]
