/**
 * The passwords of the roles tokens may name, from a pgpass-format file (`--passfile`, default
 * PGPASSFILE or ~/.pgpass), read with pg's own pgpass package (which refuses a file others may read).
 * Read again at most every CACHE_MS, so that a changed password is picked up without a restart.
 */
import { createReadStream, stat } from 'node:fs'
import helper from 'pgpass/lib/helper.js'

const CACHE_MS = 10_000

export interface PassfileEntry {
  host: string
  port: number
  database: string
  user: string
}

export class Passfile {
  private readonly known = new Map<string, { password: string | undefined; at: number }>()

  constructor(readonly file: string = helper.getFileName()) {}

  /** The password for `entry`, or undefined when the file has none (or cannot be used). */
  async password(entry: PassfileEntry): Promise<string | undefined> {
    const id = JSON.stringify([entry.host, entry.port, entry.database, entry.user])
    const cached = this.known.get(id)
    if (cached && Date.now() - cached.at < CACHE_MS) return cached.password
    const password = await new Promise<string | undefined>((resolve) =>
      stat(this.file, (err, st) => (err || !helper.usePgPass(st, this.file) ? resolve(undefined) : helper.getPassword({ ...entry, port: String(entry.port) }, createReadStream(this.file), resolve)))
    )
    if (this.known.size > 1000) this.known.clear()
    this.known.set(id, { password, at: Date.now() })
    return password
  }
}
