/**
 * --listen-policy: whether a token session may listen on a channel, as an operator's Postgres
 * function says, run as the token's role with the token's claims set as for its queries
 * (proxy/auth/claims.ts), on a connection of the proxy's own that no session can reach: no
 * setting, role or claim a session made is in effect there. One question at a time.
 */
import { serialize } from 'pg-protocol'
import type { Upstream } from '../upstream/connection'
import { exchange } from '../upstream/exchange'
import { setClaims } from '../auth/claims'
import { quoted } from '../isolation/verify'

/** `schema.function` as the call's qualified name, or undefined if it is not one. */
export function policyName(text: string): string | undefined {
  const parts = /^([^."]+|"(?:[^"]|"")+")\.([^."]+|"(?:[^"]|"")+")$/.exec(text.trim())
  return parts ? parts.slice(1, 3).map((p) => (p.startsWith('"') ? p : quoted(p.toLowerCase()))).join('.') : undefined
}

const QUIET_MS = 30_000

export class PolicyChecks {
  private upstream?: Promise<Upstream>
  private last: Promise<unknown> = Promise.resolve()
  /** Its connection closes after a quiet while. */
  private quiet?: NodeJS.Timeout
  private asked = 0

  constructor(private readonly login: () => Promise<Upstream>) {}

  /** True, or why not (the function said false, or NULL); rejects when it could not say (Postgres's error, a lost connection). */
  ask(fn: string, claims: string, channel: string): Promise<true | string> {
    clearTimeout(this.quiet)
    this.asked++
    const asked = this.last.then(() => this.run(fn, claims, channel))
    this.last = asked.catch(() => {}).then(() => {
      if (!--this.asked) this.quiet = setTimeout(() => this.close(), QUIET_MS).unref()
    })
    return asked
  }

  private async run(fn: string, claims: string, channel: string): Promise<true | string> {
    const upstream = await (this.upstream ??= this.open().catch((err) => {
      this.upstream = undefined
      throw err
    }))
    await setClaims(upstream, claims)
    const call = Buffer.concat([serialize.parse({ text: `SELECT ${fn}($1::pg_catalog.text)::pg_catalog.bool` }), serialize.bind({ values: [channel] }), serialize.execute({}), serialize.sync()])
    const answer = await exchange(upstream, call)
    if (!answer) throw new Error(`the listen policy ${fn} could not be asked: the connection to Postgres closed`)
    if (answer.error) throw new Error(`the listen policy ${fn} failed: ${answer.error.message}`)
    return answer.first === 't' || `permission denied to listen on "${channel}": the listen policy ${fn} does not allow it for this token`
  }

  private async open(): Promise<Upstream> {
    const upstream = await this.login()
    upstream.on('error', () => {})
    upstream.on('close', () => (this.upstream = undefined))
    return upstream
  }

  close() {
    this.upstream?.then((u) => u.close(), () => {})
    this.upstream = undefined
  }
}
