/**
 * What a session's messages may leave behind (proxy/isolation/reader.ts), message by message: a
 * Query or Parse by its text, a Bind by the statement it names. A session sends the same few texts
 * again and again, so the last two read are kept, and a byte comparison costs less than the text.
 */
import { ClientMessage, INERT } from '../wire/codes'
import { cString } from '../wire/startup'
import { NOTHING, type Reading } from './reader'

/**
 * A FunctionCall (code no statement text shows, which may make a custom setting no catalog shows),
 * or a message the proxy does not know how to read: whatever it did stays with the session.
 */
const UNREAD: Reading = { plain: false, code: true, unseen: true, control: true }

export class SessionReading {
  /** The unnamed statement's reading, as last parsed. */
  private unnamed: Reading = NOTHING
  private readonly lastRead: (Buffer | undefined)[] = [undefined, undefined]
  private readonly lastReading: Reading[] = [NOTHING, NOTHING]
  private nextRead = 0

  /** `statements`: the session's named statements, by name (their Parse messages). */
  constructor(private readonly read: (sql: string) => Reading, private readonly statements: ReadonlyMap<string, Buffer>) {}

  /** What running `msg` may leave behind. */
  of(msg: Buffer): Reading {
    const type = msg[0]
    if (type === ClientMessage.Query) return this.textAt(msg, 5)
    if (type === ClientMessage.Parse) {
      // (The text follows the name's NUL, whatever bytes the name holds.)
      const nameEnd = msg.indexOf(0, 5)
      const r = this.textAt(msg, nameEnd + 1)
      if (nameEnd === 5) this.unnamed = r
      return r
    }
    if (type === ClientMessage.Bind) {
      const portalEnd = msg.indexOf(0, 5)
      if (msg[portalEnd + 1] === 0) return this.unnamed
      const parse = this.statements.get(cString(msg.subarray(portalEnd + 1)))
      return parse ? this.textAt(parse, parse.indexOf(0, 5) + 1) : NOTHING
    }
    return INERT.has(type) ? NOTHING : UNREAD
  }

  /** What the statement text at `at` of `msg` (a Query or a Parse) may leave behind. */
  private textAt(msg: Buffer, at: number): Reading {
    const { lastRead } = this
    for (let i = 0; i < 2; i++) if (lastRead[i]?.equals(msg)) return this.lastReading[i]
    const end = msg.indexOf(0, at)
    const r = this.read(msg.toString('utf8', at, end < 0 ? msg.length : end)) // (no view of its own: one a statement)
    const i = this.nextRead
    this.nextRead ^= 1
    lastRead[i] = Buffer.from(msg)
    this.lastReading[i] = r
    return r
  }
}
