"""Reports of a plan: plan.md (markdown), the picture plan.svg (svg) and where the modeled time goes
(timing: the verdict, the terminal summary, the JSON)."""
