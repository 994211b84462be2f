//! `strftime_now(format)`: the template global transformers provides for "today's date".
//!
//! Python calls `datetime.now().strftime(format)` in the server's local time zone; engines run
//! in UTC containers, so this formats the current UTC time. Only the C89 directives that chat
//! templates use are supported (`%Y %y %m %d %e %H %I %M %S %p %b %B %a %A %j %%`); any other
//! directive is copied through unchanged. A template that depends on the date cannot produce a
//! stable prefix across midnight anyway; routing only needs the same text as the engine today.

use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A broken-down UTC time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Civil {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Monday.
    weekday: u32,
    /// 1-based day of the year.
    yday: u32,
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

/// Converts seconds since the Unix epoch to a UTC calendar date (proleptic Gregorian).
fn civil_from_unix(secs: i64) -> Civil {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400) as u32;
    // Shift the epoch to 0000-03-01 so leap days fall at the end of a 400-year era.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(month - 1) as usize] + day + u32::from(month > 2 && is_leap(year));
    Civil {
        year,
        month,
        day,
        hour: rem / 3600,
        minute: rem / 60 % 60,
        second: rem % 60,
        // 1970-01-01 was a Thursday (index 3).
        weekday: (days + 3).rem_euclid(7) as u32,
        yday,
    }
}

fn format_civil(t: &Civil, fmt: &str) -> String {
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let month = MONTHS[(t.month - 1) as usize];
        let weekday = WEEKDAYS[t.weekday as usize];
        let hour12 = match t.hour % 12 {
            0 => 12,
            h => h,
        };
        match d {
            'Y' => out.push_str(&t.year.to_string()),
            'y' => out.push_str(&format!("{:02}", t.year.rem_euclid(100))),
            'm' => out.push_str(&format!("{:02}", t.month)),
            'd' => out.push_str(&format!("{:02}", t.day)),
            'e' => out.push_str(&format!("{:>2}", t.day)),
            'H' => out.push_str(&format!("{:02}", t.hour)),
            'I' => out.push_str(&format!("{hour12:02}")),
            'M' => out.push_str(&format!("{:02}", t.minute)),
            'S' => out.push_str(&format!("{:02}", t.second)),
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            'b' => out.push_str(&month[..3]),
            'B' => out.push_str(month),
            'a' => out.push_str(&weekday[..3]),
            'A' => out.push_str(weekday),
            'j' => out.push_str(&format!("{:03}", t.yday)),
            '%' => out.push('%'),
            other => {
                out.push('%');
                out.push(other);
            }
        }
    }
    out
}

/// The `strftime_now` template global: formats the current UTC time.
pub(crate) fn strftime_now(fmt: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    format_civil(&civil_from_unix(secs), fmt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        // 2025-03-14 15:09:26 UTC was a Friday, day 73 of the year.
        let t = civil_from_unix(1_741_964_966);
        assert_eq!(
            format_civil(&t, "%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %I%p %e %% %Q"),
            "2025-03-14 15:09:26 Fri Friday Mar March 073 25 03PM 14 % %Q"
        );
        assert_eq!(
            format_civil(&civil_from_unix(0), "%d %b %Y %A"),
            "01 Jan 1970 Thursday"
        );
        // Leap day and the day after.
        assert_eq!(
            format_civil(&civil_from_unix(951_782_400), "%Y-%m-%d %j"),
            "2000-02-29 060"
        );
        assert_eq!(
            format_civil(&civil_from_unix(1_709_251_200), "%Y-%m-%d %j"),
            "2024-03-01 061"
        );
        assert_eq!(
            format_civil(&civil_from_unix(-86_400), "%Y-%m-%d %a"),
            "1969-12-31 Wed"
        );
    }
}
