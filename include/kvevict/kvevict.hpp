// kvevict: KV-cache eviction policies for transformer inference (umbrella header).
#pragma once
