"""User-facing tools: explain, neuron_hlo, support_matrix."""
