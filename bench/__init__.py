"""A/B bench against stock mlx-lm, teacher-forced perplexity and random full-size checkpoints.

Lives at the repo root as `bench/` and ships in the wheel as `lily_mlx.bench` (pyproject force-include);
`lily_mlx.cli` finds whichever is present. Modules import each other relatively so both names work.
"""
