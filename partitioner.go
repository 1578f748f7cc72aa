package leasehold

// PartitionFor maps a job key to one of n partitions the way Kafka's default
// partitioner does (murmur2 of the key bytes, sign bit cleared, modulo n), so
// a key lands on the same partition number here as in a Kafka topic with the
// same partition count. It panics if n is not positive.
func PartitionFor(key []byte, n int) Partition {
	if n <= 0 {
		panic("leasehold: PartitionFor needs a positive partition count")
	}
	return Partition(int(murmur2(key)&0x7fffffff) % n)
}

// murmur2 is Kafka's variant of MurmurHash2 (seed 0x9747b28c).
func murmur2(data []byte) uint32 {
	const (
		seed = 0x9747b28c
		m    = 0x5bd1e995
		r    = 24
	)
	length := len(data)
	h := uint32(seed) ^ uint32(length)
	for i := 0; i+4 <= length; i += 4 {
		k := uint32(data[i]) | uint32(data[i+1])<<8 | uint32(data[i+2])<<16 | uint32(data[i+3])<<24
		k *= m
		k ^= k >> r
		k *= m
		h *= m
		h ^= k
	}
	tail := length &^ 3
	switch length % 4 {
	case 3:
		h ^= uint32(data[tail+2]) << 16
		fallthrough
	case 2:
		h ^= uint32(data[tail+1]) << 8
		fallthrough
	case 1:
		h ^= uint32(data[tail])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return h
}
