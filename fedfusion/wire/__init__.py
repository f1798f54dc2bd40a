"""What messages carry: typed specs, record and metric keys, the quantised codec, the finiteness check every reply
passes."""
