"""Row gather and scatter-add over 2-D tables (catalog rows 79 and 80): ``gather``, ``scatter_add``."""
