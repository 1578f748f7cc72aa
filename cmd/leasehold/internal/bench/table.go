package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strconv"
	"text/tabwriter"
)

// WriteTable prints rows as an aligned table, each row's note below it.
func WriteTable(w io.Writer, rows []Row) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "NAME\tVALUE\tUNIT\tBASELINE\tRATIO\tRUNS\t")
	for _, r := range rows {
		base, ratio := "-", "-"
		if r.Baseline != nil {
			base = num(*r.Baseline)
		}
		if r.Ratio != nil {
			ratio = strconv.FormatFloat(*r.Ratio, 'f', 3, 64)
		}
		value := num(r.Value)
		if r.Runs == 0 {
			value = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t\n", r.Name, value, r.Unit, base, ratio, r.Runs)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	for _, r := range rows {
		if r.Note != "" {
			if _, err := fmt.Fprintf(w, "%s: %s\n", r.Name, r.Note); err != nil {
				return err
			}
		}
	}
	return nil
}

// WriteJSON prints rows as a JSON array.
func WriteJSON(w io.Writer, rows []Row) error {
	if rows == nil {
		rows = []Row{}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rows)
}

// num formats a figure with about four significant digits.
func num(v float64) string {
	switch a := math.Abs(v); {
	case a >= 1000:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case a >= 100:
		return strconv.FormatFloat(v, 'f', 1, 64)
	case a >= 1:
		return strconv.FormatFloat(v, 'f', 3, 64)
	default:
		return strconv.FormatFloat(v, 'g', 4, 64)
	}
}
