package parallel

// TrainingSetter is implemented by modules whose forward differs between
// training and evaluation (Dropout): Train and Eval switch them.
type TrainingSetter interface {
	// SetTraining selects training (on) or evaluation (off) mode.
	SetTraining(on bool)
}

// Train puts every module of root's tree that has a mode (TrainingSetter)
// in training mode, like PyTorch's model.train(). A nil module in the tree
// is an error wrapping ErrInvalid, and then no module is switched.
func Train(root Module) error { return setTraining(root, true) }

// Eval puts every module of root's tree that has a mode in evaluation mode
// (Dropout becomes the identity), like PyTorch's model.eval(). Errors as
// Train's.
func Eval(root Module) error { return setTraining(root, false) }

func setTraining(root Module, on bool) error {
	var ms []TrainingSetter
	err := Walk(root, func(_ string, m Module) error {
		if s, ok := m.(TrainingSetter); ok {
			ms = append(ms, s)
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, m := range ms {
		m.SetTraining(on)
	}
	return nil
}
