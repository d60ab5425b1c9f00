/**
 * What a session made that follows it from backend to backend (transaction pooling): its settings
 * (SET, RESET, set_config(…, false), SET ROLE), its SQL prepared statements and its LISTEN channels. Learned only from
 * what Postgres says: the values it reports (ParameterStatus), and its account of the session's
 * state after a transaction that did more than plain reads and writes (proxy/isolation/verify.ts).
 * Made again on each backend the session borrows, at the head of its next write (`carried`).
 */
import { carry, CARRIED_TEXT_BYTES, type Carried, type Found } from '../isolation/verify'
import { prepareIn } from '../isolation/reader'
import { messages } from '../wire/bytes'
import { ServerMessage } from '../wire/codes'

/**
 * Settings Postgres reports (ParameterStatus) that a session may set: learnt from the reports as they
 * pass, whatever set them, and carried where they differ from the login's (the others Postgres
 * reports it does not let a session set).
 */
const REPORTED = new Set(['application_name', 'client_encoding', 'DateStyle', 'default_transaction_read_only', 'IntervalStyle', 'search_path', 'standard_conforming_strings', 'TimeZone'])

type Prepared = ReadonlyMap<string, { text: string; prepare: string }>
const NONE_PREPARED: Prepared = new Map()

export class SessionState {
  /** Reported settings whose value, as the client was last told it, is not the login's. */
  private changed?: Map<string, string>
  /** By Postgres's last account: the settings made for the session, the role it set, its SQL prepared statements (name → the text that made it, and its PREPARE cut from that). */
  private settings: Record<string, string> = {}
  private role?: string
  private prepared = NONE_PREPARED
  /** The channels it listens on (through the hub: proxy/notify/session-listening.ts). */
  private channels: readonly string[] = []
  /** The messages that make it all again, and all but the prepared statements, for a standby (false: nothing to make; undefined: to be made). */
  private made?: Carried | false
  private madeForReplica?: Carried | false

  /** `login`: what the login reported (see loginReports), as the client was told it. */
  constructor(private readonly login: ReadonlyMap<string, string>) {}

  /** A ParameterStatus: whether it changes what the client was told. */
  report(name: string, value: string): boolean {
    const at = this.login.get(name)
    if ((this.changed?.get(name) ?? at) === value) return false
    if (value === at) this.changed!.delete(name) // (it differed: so it was changed)
    else (this.changed ??= new Map()).set(name, value)
    if (REPORTED.has(name)) this.made = this.madeForReplica = undefined
    return true
  }

  private reported(name: string): string | undefined {
    return this.changed?.get(name) ?? this.login.get(name)
  }

  /**
   * Postgres's account of the session's state after a transaction: what of it cannot follow the
   * session, if anything (then the session keeps its backend). Settings follow up to CARRIED_TEXT_BYTES
   * of values (the proxy holds them for the session's life, and sends them at each handover). A
   * prepared statement follows only where its PREPARE can be cut from its text as Postgres read it:
   * by text in UTF-8, with standard strings on (as the parser reads them).
   */
  learn(f: Found): string | undefined {
    let cannot: string | undefined
    let bytes = 0
    for (const name in f.settings) bytes += name.length + f.settings[name].length
    if (bytes > CARRIED_TEXT_BYTES) cannot = 'setting'
    this.settings = cannot ? {} : f.settings
    this.role = f.role
    this.made = this.madeForReplica = undefined
    const prepared = new Map<string, { text: string; prepare: string }>()
    const readable = this.reported('client_encoding') === 'UTF8' && this.reported('standard_conforming_strings') !== 'off'
    for (const [name, text] of f.prepared) {
      const known = this.prepared.get(name)
      const prepare = known?.text === text ? known.prepare : readable ? prepareIn(text, name) : undefined
      if (prepare === undefined) cannot = 'prepare'
      else prepared.set(name, { text, prepare })
    }
    this.prepared = prepared
    return cannot
  }

  /** The session listens on `channels` now: each backend it borrows on the primary listens there too. */
  listenOn(channels: readonly string[]) {
    this.channels = channels
    this.made = undefined
  }

  /**
   * The messages that make the session's state again on another backend (undefined: it has none).
   * On a standby, no prepared statements (what runs them, EXECUTE, goes to the primary) and no channels (a standby refuses LISTEN).
   */
  carried(onReplica = false): Carried | undefined {
    const made = onReplica ? this.madeForReplica : this.made
    if (made !== undefined) return made || undefined
    const settings = { ...this.settings }
    for (const name of REPORTED) {
      const value = this.changed?.get(name)
      if (value !== undefined) settings[name.toLowerCase()] = value
      else delete settings[name.toLowerCase()]
    }
    const prepares = onReplica ? [] : [...this.prepared.values()].map((p) => p.prepare)
    const carried = carry(settings, this.role, prepares, onReplica ? [] : this.channels) ?? false
    onReplica ? (this.madeForReplica = carried) : (this.made = carried)
    return carried || undefined
  }
}

/** The last few logins' reports, each shared by the sessions whose login said the same (most of a key's, or all). */
const logins: ReadonlyMap<string, string>[] = []
const LOGINS_KEPT = 8

/** The settings a login's answer reports (ParameterStatus), by name. */
export function loginReports(answer: Buffer): ReadonlyMap<string, string> {
  const reports = new Map<string, string>()
  for (const m of messages(answer)) {
    if (m[0] !== ServerMessage.ParameterStatus) continue
    const end = m.indexOf(0, 5)
    reports.set(m.toString('utf8', 5, end), m.toString('utf8', end + 1, m.length - 1))
  }
  const same = logins.find((l) => l.size === reports.size && [...reports].every(([name, value]) => l.get(name) === value))
  if (same) return same
  logins.unshift(reports)
  logins.length = Math.min(logins.length, LOGINS_KEPT)
  return reports
}
