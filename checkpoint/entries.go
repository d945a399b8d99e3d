package checkpoint

import (
	"encoding/base64"
	"fmt"
	"math"
	"strconv"
)

// entry is a user entry as the manifest holds it: its type and its value
// in a form every JSON reader keeps exactly (int64 and float64 as decimal
// strings, so no reader rounds them through a double; bytes in base64).
type entry struct {
	Type  string `json:"type"`
	Value any    `json:"value"`
}

// encodeEntry converts an entry of State.Entries for the manifest. The
// types are bool, int64, float64, string, []byte, []int64 and []float64.
func encodeEntry(v any) (entry, error) {
	f := func(x float64) string { return strconv.FormatFloat(x, 'g', -1, 64) }
	switch x := v.(type) {
	case bool:
		return entry{"bool", x}, nil
	case int64:
		return entry{"int64", strconv.FormatInt(x, 10)}, nil
	case float64:
		return entry{"float64", f(x)}, nil
	case string:
		return entry{"string", x}, nil
	case []byte:
		return entry{"bytes", base64.StdEncoding.EncodeToString(x)}, nil
	case []int64:
		s := make([]string, len(x))
		for i, n := range x {
			s[i] = strconv.FormatInt(n, 10)
		}
		return entry{"[]int64", s}, nil
	case []float64:
		s := make([]string, len(x))
		for i, n := range x {
			s[i] = f(n)
		}
		return entry{"[]float64", s}, nil
	}
	return entry{}, fmt.Errorf("type %T: entries are bool, int64, float64, string, []byte, []int64 or []float64", v)
}

// decode returns the entry's Go value.
func (e entry) decode() (any, error) {
	str := func(v any) (string, error) {
		s, ok := v.(string)
		if !ok {
			return "", fmt.Errorf("%s value %v is not a string", e.Type, v)
		}
		return s, nil
	}
	list := func() ([]string, error) {
		a, ok := e.Value.([]any)
		if !ok {
			return nil, fmt.Errorf("%s value is not a list", e.Type)
		}
		out := make([]string, len(a))
		for i, v := range a {
			s, err := str(v)
			if err != nil {
				return nil, err
			}
			out[i] = s
		}
		return out, nil
	}
	parseFloat := func(s string) (float64, error) {
		x, err := strconv.ParseFloat(s, 64)
		if err != nil && !math.IsInf(x, 0) {
			return 0, err
		}
		return x, nil
	}
	switch e.Type {
	case "bool":
		b, ok := e.Value.(bool)
		if !ok {
			return nil, fmt.Errorf("bool value %v", e.Value)
		}
		return b, nil
	case "int64":
		s, err := str(e.Value)
		if err != nil {
			return nil, err
		}
		return strconv.ParseInt(s, 10, 64)
	case "float64":
		s, err := str(e.Value)
		if err != nil {
			return nil, err
		}
		return parseFloat(s)
	case "string":
		return str(e.Value)
	case "bytes":
		s, err := str(e.Value)
		if err != nil {
			return nil, err
		}
		return base64.StdEncoding.DecodeString(s)
	case "[]int64":
		ss, err := list()
		if err != nil {
			return nil, err
		}
		out := make([]int64, len(ss))
		for i, s := range ss {
			if out[i], err = strconv.ParseInt(s, 10, 64); err != nil {
				return nil, err
			}
		}
		return out, nil
	case "[]float64":
		ss, err := list()
		if err != nil {
			return nil, err
		}
		out := make([]float64, len(ss))
		for i, s := range ss {
			if out[i], err = parseFloat(s); err != nil {
				return nil, err
			}
		}
		return out, nil
	}
	return nil, fmt.Errorf("unknown type %q", e.Type)
}
