"""cocodiff attention processors (V-First): :mod:`.ulysses` holds what every family shares, one
module per model family, and :mod:`.families` which processor replaces which and installs them."""
