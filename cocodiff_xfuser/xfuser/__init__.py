"""Everything cocodiff-xfuser changes in xfuser 0.7.0: the patches (:mod:`.hooks` applies them as
xfuser's modules load). Empty, so that importing one of its modules loads none of the others."""
