"""The prefix-sum kernel (layer 1): ``cumsum``."""
