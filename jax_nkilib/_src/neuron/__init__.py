"""The Neuron path: kernel compilers (nki-backed and dry-run) and the custom-call lowering."""
