"""Token dispatch/combine backends behind one DeepEP-shaped interface."""
