package local

// Pipelined trees: reduce up and broadcast down any parent array, so one
// pair of generators serves binary trees, chains and the double tree.

// heapParents is a binary tree in heap order: parent(i) = (i-1)/2.
func heapParents(k int) []int {
	par := make([]int, k)
	for i := range par {
		par[i] = (i - 1) / 2
	}
	par[0] = -1
	return par
}

// chainParents is a chain: parent(i) = i-1.
func chainParents(k int) []int {
	par := make([]int, k)
	for i := range par {
		par[i] = i - 1
	}
	return par
}

// reduceTree reduces elements [off, off+n) of every member's send up the
// tree par (over order) into dst of order[0]; inner nodes keep partial
// results in scratch. Pieces pipeline the levels.
func reduceTree(b *builder, order, par []int, off, n, piece int, dst bufID) {
	k := len(order)
	children := make([][]int, k)
	for i := 1; i < k; i++ {
		children[par[i]] = append(children[par[i]], i)
	}
	// value returns where node i's reduced piece lives after it is done.
	value := func(i int, s span) ref {
		switch {
		case i == 0:
			return ref{order[0], dst, off + s.lo, s.n}
		case len(children[i]) == 0:
			return ref{order[i], bufSend, off + s.lo, s.n}
		}
		return ref{order[i], bufScratch, off + s.lo, s.n}
	}
	for _, s := range pipeline(n, piece) {
		for i := k - 1; i >= 0; i-- { // children before parents
			if len(children[i]) == 0 && i != 0 {
				continue
			}
			srcs := []ref{{order[i], bufSend, off + s.lo, s.n}}
			for _, c := range children[i] {
				srcs = append(srcs, value(c, s))
			}
			if len(srcs) == 1 {
				b.copyTo(value(i, s), srcs[0])
			} else {
				b.reduceTo(value(i, s), srcs...)
			}
		}
	}
}

// broadcastTree copies recv[off, off+n) of order[0] down the tree par.
func broadcastTree(b *builder, order, par []int, off, n, piece int) {
	for _, s := range pipeline(n, piece) {
		for i := 1; i < len(order); i++ { // parents before children
			b.copyTo(ref{order[i], bufRecv, off + s.lo, s.n}, ref{order[par[i]], bufRecv, off + s.lo, s.n})
		}
	}
}
