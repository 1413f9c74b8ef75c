"""Building blocks of the Absolute Zero workflow (``asyncrl.algos.absolute_zero``): the
learnability filter and the self-play domains."""
