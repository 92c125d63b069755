"""The headline bounds' names and the rule that picks one: a leaf module (no numpy), so the CLI's help is
built from it and cannot drift from what ``analysis.choose_headline`` does."""

HEADLINES = ("auto", "gaussian", "fdp-gdp", "fdp", "steinke", "steinke-two-sided", "fdp-gdp-hull", "steinke-hull")
AUTO_RULE = ("auto: steinke at delta = 0; else fdp for a non-Gaussian mechanism (Laplace); else gaussian for "
             "white-box sums, fdp-gdp otherwise")
