# launch/mpirun.sh's reading of mpirun's output (POSIX awk: mawk and gawk). mpirun's own
# messages are help boxes of many lines between rulers of dashes; the ones a failing job
# produces say the same thing several times, and without --quiet they bury the rank's own
# one-line error, while --quiet hides them all, including the only line that says which rank
# died. So mpirun runs without --quiet and this turns the boxes it knows into one line each
# (or nothing, where the rank already said why), passes every other line through as it comes,
# and prints unknown boxes unchanged.
#
# It reads mpirun's stderr (stdout, the ranks' own, is not touched).
# Variables (-v): me (the launcher's name, for its lines), dir (a directory shared with the
# launcher), np, slots and advice (for the "not enough slots" line).
# Files it writes in dir: lost (the host mpirun lost: the launcher names it and its ranks), end (the first line saying how the job ends, "CODE why": it starts the launcher's grace
# period for mpirun), verdict (the exit status the launcher uses instead of mpirun's, where this
# names the failure: 75 a rank or host lost, 70 a rank crashed, 2 too many ranks for the slots).

function say(text) {
  print me ": " text
  fflush()
}
function put(file, text) {
  print text > file
  close(file)
}
# The first way the job ends is the one reported; later boxes are its consequences.
function ended(code, why) {
  if (end_code != "") return
  end_code = code
  put(dir "/end", code " " why)
}
function verdict(code) {
  if (verdict_code != "") return
  verdict_code = code
  put(dir "/verdict", code)
}
# The word after `label` in `text` (labels are "node", "PID:", ...), without trailing dots.
function word_after(text, label,    n, w, i) {
  n = split(text, w, " ")
  for (i = 1; i < n; i++)
    if (w[i] == label) {
      sub(/[.,]$/, "", w[i + 1])
      return w[i + 1]
    }
  return ""
}
# The text between `from` and the next `to` (exclusive), or "".
function between(text, from, to,    at, rest) {
  at = index(text, from)
  if (at == 0) return ""
  rest = substr(text, at + length(from))
  at = index(rest, to)
  return at ? substr(rest, 1, at - 1) : rest
}
# A lost host is reported by the launcher after mpirun has exited, with the ranks it ran, last.
function lost_host(node) {
  lost_reported = 1
  ended(75, "host " node " was lost")
  verdict(75)
  put(dir "/lost", node)
}

# One box, its lines joined (whitespace squeezed): a line, nothing, or the box unchanged.
function box_done(    t, rank, code, sig, name, node, who, pid, i) {
  t = ""
  for (i = 1; i <= nbox; i++) t = t " " boxl[i]
  gsub(/[ \t]+/, " ", t)
  if (t ~ /mpirun noticed that process rank [0-9]+ with PID [0-9]+ on node [^ ]+ exited on signal [0-9]+/) {
    rank = word_after(t, "rank"); node = word_after(t, "node"); sig = word_after(t, "signal")
    name = between(t, "signal " sig " (", ")")
    # Killed from outside (kill, the OOM killer, a scheduler): the run may go on from its last
    # checkpoint (EX_TEMPFAIL, as the watchdog's 75). A crash (SEGV, ABRT, ...) is a bug (EX_SOFTWARE).
    code = (sig == 9 || sig == 15 || sig == 1 || sig == 2) ? 75 : 70
    ended(code, "rank " rank " was killed by signal " sig)
    verdict(code)
    pid = word_after(t, "PID")  # 0 for the ranks of mpirun's own node
    say("error: rank " rank " (" (pid == "0" ? "" : "PID " pid " ") "on " node ") was killed by signal " sig " (" name \
        "); the other ranks were ended (exit " code (code == 75 ? ": resume from the last checkpoint" : "") ")")
  } else if (t ~ /MPI_ABORT was invoked on rank [0-9]+ /) {
    rank = word_after(t, "rank"); code = word_after(t, "errorcode")
    ended(code, "rank " rank " called MPI_Abort with error code " code)
    if (!rank_error) say("error: rank " rank " called MPI_Abort (error code " code "); the job is ended")
  } else if (t ~ /Primary job +terminated normally, but/) {
    # the ranks' own lines (or the box below) say which failed
  } else if (t ~ /mpirun detected that one or more processes exited with non-zero status/) {
    who = between(t, "Process name: [[", " "); sub(/.*\],/, "", who); sub(/\]$/, "", who)  # [[job,n],RANK]
    code = word_after(t, "code:")
    ended(code, "rank " who " exited with status " code)
    if (!rank_error) say("error: rank " who " exited with status " code "; the other ranks were ended")
  } else if (t ~ /not enough slots available in the system to satisfy the [0-9]+ slots/) {
    verdict(2)
    say("error: -np " np " asks for more ranks than the " slots ": " advice)
  } else if (t ~ /ORTE has lost communication with a remote daemon/) {
    node = between(t, "Remote daemon: ", " This"); node = word_after(node, "node")
    if (!lost_reported) lost_host(node)
  } else if (t ~ /ORTE was unable to reliably start one or more daemons/) {
    # mpirun's words for a daemon whose launch agent (ssh) ended, at the start or later: a host
    # lost if the agent says its connection closed ("Connection to HOST closed by remote host.",
    # perhaps after this box), else a daemon that did not start (the agent's lines say why).
    daemon_failed = 1
    ended(1, "a node's daemon failed")
    if (gone_host != "" && !lost_reported) lost_host(gone_host)
  } else if (t ~ /ORTE does not know how to route a message to the specified daemon/) {
    # a consequence of a daemon that failed (above)
  } else if (t ~ /Open MPI failed to TCP connect to a peer MPI process/) {
    if (end_code == "")  # else a consequence of the failure already reported
      say("warning: a rank on " word_after(t, "host:") " (PID " word_after(t, "PID:") ") could not connect to a " \
          "peer: " between(t, "Message: ", " Error:") ": " between(t, "Error: ", " ---"))
  } else if (t ~ /An MPI communication peer process has unexpectedly disconnected/) {
    if (end_code == "")
      say("warning: a rank on " word_after(t, "host:") " (PID " word_after(t, "PID:") ") lost its connection to a " \
          "peer on " between(t, "Peer host: ", " ") " (the peer died, or the network failed)")
  } else if (t ~ /unable to complete a TCP connection to another process/) {
    say("error: a process on " word_after(t, "host:") " could not open a TCP connection to " \
        between(t, "Remote host: ", " This") " (a firewall, or no route between them: RETAIN_MPI_IFACE names " \
        "the network every node reaches)")
  } else {
    print ruler
    for (i = 1; i <= nbox; i++) print boxl[i]
    print ruler
    fflush()
  }
}

/^-+$/ && length($0) >= 40 {
  if (in_box) { in_box = 0; box_done() } else { in_box = 1; nbox = 0; ruler = $0 }
  next
}
in_box { boxl[++nbox] = $0; next }
/^\[[^]]*\] [0-9]+ more process(es)? ha(s|ve) sent help message / { next }
/^\[[^]]*\] Set MCA parameter "orte_base_help_aggregate" to 0/ { next }
/^Connection to [^ ]+ closed by remote host\.$/ {
  gone_host = $3
  if (daemon_failed && !lost_reported) lost_host(gone_host)
  else if (!lost_reported) held_gone = held_gone $0 "\n"
  next
}
/^[^ ]+: error: / { rank_error = 1 }
{ print; fflush() }

END {
  if (in_box) {  # cut short: as it came
    print ruler
    for (i = 1; i <= nbox; i++) print boxl[i]
  }
  if (daemon_failed && !lost_reported)
    say("error: mpirun could not start its daemon on a node, or lost it; the lines above (the launch " \
        "agent's, e.g. ssh's) say which and why")
  else if (!lost_reported) printf "%s", held_gone
}
