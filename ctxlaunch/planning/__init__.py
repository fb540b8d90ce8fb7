"""What to pick: the fit verdict with its suggestions (plan), and the search over layouts
(advise)."""
